"""Judge one `orca-serve` start of scripts/check_vllm_release.sh from its output.

    python scripts/startup_outcome.py LOG HEALTHY EXIT_CODE [EXPECTED]   (exit 0: it passes)

Passes when the server answered /health (a CPU build of vLLM), or when it stopped at an error of
vLLM's having passed every check of orca-serve's: no "orca-serve: error" line, and the frame
that raised is vLLM's, not ours (our frames may appear above it: they are the call into vLLM's
launcher). EXPECTED "device" (default): that error must be vLLM's device detection (the GPU
wheel on a machine without a GPU); "vllm": any error raised in vLLM's code (the GPU wheel made to
take the CPU platform, which then lacks the CPU kernels).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# vLLM's words when it finds no device to run on (the GPU wheel without a GPU)
DEVICE_ERRORS = ("Failed to infer device type", "No CUDA GPUs are available",
                 "Found no NVIDIA driver")
FRAME = re.compile(r'^\s*File "([^"]+)", line \d+, in (\S+)')
OURS = ("/orca_serve/", "/orca_calibrate/", "/orca_demo/")


def last_traceback(lines: list[str]) -> tuple[list[tuple[str, str]], str]:
    """(frames as (file, function), the exception line) of the last traceback in the output."""
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback ")), default=None)
    if start is None:
        return [], ""
    frames, exc = [], ""
    for line in lines[start + 1:]:
        m = FRAME.match(line)
        if m:
            frames.append((m.group(1), m.group(2)))
        elif line and not line.startswith(" "):
            exc = line.strip()
            break
    return frames, exc


def judge(text: str, healthy: bool, rc: int, expected: str = "device") -> tuple[bool, str]:
    lines = text.splitlines()
    refusal = next((line for line in lines if "orca-serve: error" in line), None)
    if refusal is not None:
        return False, f"orca-serve refused to start: {refusal.strip()}"
    if healthy:
        return True, "served: /health answered 200"
    frames, exc = last_traceback(lines)
    if expected == "device" and not any(e in text for e in DEVICE_ERRORS):
        return False, f"exit {rc} without vLLM's device error; last exception: {exc or 'none'}"
    if not frames:
        return False, f"exit {rc} with no traceback to tell whose error it is"
    raised_in = frames[-1][0]
    ours = [f"{Path(f).name}:{fn}" for f, fn in frames if any(o in f for o in OURS)]
    if any(o in raised_in for o in OURS) or "/vllm/" not in raised_in:
        return False, f"raised outside vLLM ({raised_in}): {exc}"
    what = "vLLM's device detection" if expected == "device" else "an error of vLLM's"
    return True, (f"stopped at {what}: {exc} (raised in "
                  f"{'/'.join(Path(raised_in).parts[-3:])}; orca-serve frames above it, the call "
                  f"into vLLM's launcher: {' > '.join(ours) or 'none'})")


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not 3 <= len(argv) <= 4:
        sys.exit(__doc__)
    log, healthy, rc, *expected = argv
    ok, why = judge(Path(log).read_text(errors="replace"), healthy == "1", int(rc), *expected)
    print(("PASS " if ok else "FAIL ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
