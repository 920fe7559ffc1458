"""Judge one `orca-serve` start of benchmarks/check_vllm_release.sh from its output.

    python benchmarks/startup_outcome.py LOG HEALTHY EXIT_CODE     (exit 0: the start passes)

Passes when the server answered /health (a CPU build of vLLM), or when it stopped at vLLM's own
device detection (the GPU wheel on a machine without a GPU) having passed every check of
orca-serve's: no "orca-serve: error" line, and the frame that raised is vLLM's, not ours (our
frames may appear above it: they are the call into vLLM's launcher).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# vLLM's words when it finds no device to run on (the GPU wheel without a GPU)
DEVICE_ERRORS = ("Failed to infer device type", "No CUDA GPUs are available",
                 "Found no NVIDIA driver")
FRAME = re.compile(r'^\s*File "([^"]+)", line \d+, in (\S+)')
OURS = ("/orca_serve/", "/calibration/")


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


def judge(text: str, healthy: bool, rc: int) -> tuple[bool, str]:
    lines = text.splitlines()
    refusal = next((line for line in lines if "orca-serve: error" in line), None)
    if refusal is not None:
        return False, f"orca-serve refused to start: {refusal.strip()}"
    if healthy:
        return True, "served: /health answered 200"
    frames, exc = last_traceback(lines)
    device = next((e for e in DEVICE_ERRORS if e in text), None)
    if device is None:
        return False, f"exit {rc} without vLLM's device error; last exception: {exc or 'none'}"
    if not frames:
        return True, f"stopped at vLLM's device detection ({device!r}), no traceback"
    raised_in = frames[-1][0]
    ours = [f"{Path(f).name}:{fn}" for f, fn in frames if any(o in f for o in OURS)]
    if any(o in raised_in for o in OURS):
        return False, f"raised in our code ({raised_in}): {exc}"
    return True, (f"stopped at vLLM's device detection: {exc} (raised in "
                  f"{'/'.join(Path(raised_in).parts[-3:])}; orca-serve frames above it, the call "
                  f"into vLLM's launcher: {' > '.join(ours) or 'none'})")


def main(argv: list[str]) -> int:
    log, healthy, rc = argv
    ok, why = judge(Path(log).read_text(errors="replace"), healthy == "1", int(rc))
    print(("PASS " if ok else "FAIL ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
