"""Run a command; print its wall time and the CPU time of its whole process tree.

`time make test` misses CPU: a process's CPU reaches its parent only when the parent reaps it,
and a server stopped by signal can leave its EngineCore to be reaped by init. Here the command
runs under a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`): every descendant that outlives
its parent is re-parented to this process and reaped here, so RUSAGE_CHILDREN ends up holding
the CPU of every process the command started. Linux only.

    python scripts/tree_cpu.py make test
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")
    t = time.monotonic()
    rc = subprocess.call(sys.argv[1:])
    wall = time.monotonic() - t
    while True:  # the orphans left running: reaped when they end
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"tree_cpu: exit {rc}, wall {wall:.1f} s, CPU of the whole tree "
          f"{r.ru_utime + r.ru_stime:.1f} s (user {r.ru_utime:.1f} s, sys {r.ru_stime:.1f} s), "
          f"orphans reaped {time.monotonic() - t - wall:.1f} s after", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
