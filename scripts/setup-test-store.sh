#!/usr/bin/env bash
# The store server the fleet tests start (tests/redis_server.py): redis-server from Debian,
# installed when missing. Quick and quiet when present; the server's own default needs none.
set -euo pipefail
command -v redis-server >/dev/null && exit 0
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "redis-server is missing and apt-get needs root: install it (apt-get install redis-server)" \
         "or the fleet tests fail" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -qq redis-server >/dev/null 2>&1 \
  || { $SUDO apt-get update -qq >/dev/null && $SUDO apt-get install -y -qq redis-server >/dev/null; }
