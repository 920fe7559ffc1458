"""Run a command; print its wall time and the CPU time of its whole process tree.

`time make test` misses CPU: a process's CPU reaches its parent only when the parent reaps it,
and a server stopped by signal can leave its EngineCore to be reaped by init. Here the command
runs under a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`): every descendant that outlives
its parent is re-parented to this process and reaped here, so RUSAGE_CHILDREN ends up holding
the CPU of every process the command started. Reaped as each ends, as init would: a zombie kept
to the end would keep its process group alive for a test that waits for the group to empty
(the demo's stop waited out its 40 s of grace so). Linux only.

    python scripts/tree_cpu.py make test
    python scripts/tree_cpu.py --by-kind make test
    python scripts/tree_cpu.py --by-test make test

`--by-kind` also splits that CPU by kind of process (pytest workers, test servers, engine cores,
CLI subprocesses, redis, ...) and counts the processes that loaded torch and vLLM's compiled
extension, by reading /proc every `POLL_S`: a process stopped by SIGKILL runs no exit hook, so
the tree is watched from outside. What a process spent after its last reading, and processes
shorter than one reading, show as "between readings" (the tree's total less the kinds' sum).
The torch and vLLM counts are lower bounds: a process's mapped libraries are read every
`MAPS_EVERY` readings, so one that ends sooner may be missed.

`--by-test` splits the same CPU by test module instead: each reading's CPU of a process goes to
the module its nearest pytest-xdist ancestor is running (xdist titles a worker "[pytest-xdist
running] tests/test_x.py::name"), so a test server's engine core counts for the module that was
running when it spent it. A process that lost its worker (an orphan re-parented here) keeps the
module it last had; CPU spent while a worker sat between tests shows as "(between tests)". Each
module's CPU is split into the worker's own (in-process engines, simulations) and its
children's (servers, engines, CLIs); then the costliest tests, and each worker's timeline (the
modules it ran, when): where one worker ran on alone at the end, the run waited on it.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
POLL_S = 0.2
BUSY_BIN_S = 30
MAPS_EVERY = 10  # readings between two looks at a process's mapped libraries
TICK = os.sysconf("SC_CLK_TCK")

# (kind, a word of the command line's first three words that marks it), first match wins; the
# command line is read at every reading, so a process renamed by setproctitle (VLLM::EngineCore,
# xdist's "[pytest-xdist running] ...") is classed by its latest title
KINDS = [("vLLM engine core", "VLLM::EngineCore"), ("vLLM worker", "VLLM::Worker"),
         ("vLLM API server (spawned: --api-server-count)", "VLLM::APIServer"),
         ("vLLM DP coordinator", "VLLM::DPCoordinator"),
         ("vLLM spawned (before its title)", "multiprocessing.spawn"),
         ("multiprocessing resource tracker", "multiprocessing.resource_tracker"),
         ("pytest worker (xdist)", "[pytest-xdist"),
         ("pytest worker (xdist)", "sys.stdin.readline"),
         ("pytest controller", "-m pytest"), ("test zygote", "tests.zygote"),
         ("test engine forker (and its children before their title)", "orca-engine-forker"),
         ("test server (orca-serve)", "orca-serve"),
         ("plain vLLM server", "vllm.entrypoints.openai.api_server"),
         ("demo (orca_serve.startup.demo)", "orca_serve.startup.demo"),
         ("orca-serve CLI (-m orca_serve.startup.cli)", "orca_serve.startup.cli"),
         ("calibrate CLI", "orca-calibrate"), ("calibrate CLI", "orca_calibrate"),
         ("redis-server", "redis-server"), ("lint-imports", "lint-imports")]
SHELLS = {"make", "sh", "bash", "flock", "timeout"}  # by the program's name


def kind_of(argv: list[str]) -> str:
    line = " ".join(argv[:3])
    for kind, word in KINDS:
        if word in line:
            return kind
    if not argv:
        return "?"
    name = os.path.basename(argv[0].split()[0])
    if name in SHELLS or "setup-" in line:
        return "make / shell / setup"
    if name.startswith("python") and argv[1:2] == ["-c"]:
        return "python -c (test subprocess)"
    return name


@dataclass
class Proc:
    kind: str
    cpu_s: float = 0.0
    torch: bool = False
    vllm: bool = False
    module: str = "(outside tests)"  # --by-test: the test module it last spent CPU for
    test: str = "(outside tests)"  # --by-test: the test (node id) it last spent CPU for


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _maps_flags(pid: int) -> tuple[bool, bool]:
    """Whether the process has torch's and vLLM's compiled libraries mapped."""
    try:
        maps = _read(f"/proc/{pid}/maps")
    except OSError:
        return False, False
    return b"libtorch_cpu" in maps, b"/vllm/_C" in maps


class Watcher(threading.Thread):
    """Reads /proc every POLL_S: the processes whose parent is in the tree join it (orphans are
    re-parented to this subreaper, whose pid roots the tree); each keeps its latest CPU."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.procs: dict[tuple[int, int], Proc] = {}  # (pid, start time): pids are reused
        self.live: dict[int, int] = {os.getpid(): -1}  # tree pid -> its start time
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.cumulative: list[tuple[float, float]] = []  # (s since start, CPU seen so far)
        # --by-test: CPU per (test node id, spent by the worker itself); each worker's timeline
        self.by_test: dict[tuple[str, bool], float] = defaultdict(float)
        self.timeline: dict[int, list[tuple[float, str]]] = defaultdict(list)

    def run(self) -> None:
        while not self.stop.is_set():
            self.read_once()
            self.stop.wait(POLL_S)

    def read_once(self) -> None:
        stats = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    stat = _read(f"/proc/{name}/stat")
                except OSError:
                    continue
                f = stat[stat.rindex(b")") + 2:].split()  # fields from the 3rd (state) on
                stats[int(name)] = (int(f[1]), int(f[19]), (int(f[11]) + int(f[12])) / TICK)
        live = {os.getpid(): -1}
        changed = True
        while changed:  # parents before children, whatever the order of /proc
            changed = False
            for pid, (ppid, start, _) in stats.items():
                if pid not in live and ppid in live:
                    live[pid] = start
                    changed = True
        argvs: dict[int, list[str]] = {}
        for pid, start in live.items():
            if start < 0:
                continue
            try:
                cmdline = _read(f"/proc/{pid}/cmdline")
                argvs[pid] = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
            except OSError:
                continue
        for pid, argv in argvs.items():
            p = self.procs.setdefault((pid, live[pid]), Proc("?"))
            if argv:  # a zombie's is empty: it keeps its last kind
                p.kind = kind_of(argv)
            p.test = _running(pid, stats, argvs) or p.test
            self.by_test[(p.test, _is_worker(argv))] += stats[pid][2] - p.cpu_s
            if _is_worker(argv) and not _is_worker(argvs.get(stats[pid][0], [])):  # not a fork
                module = p.test.split("::")[0]
                line = self.timeline[pid]
                if not line or line[-1][1] != module:
                    line.append((time.monotonic() - self.t0, module))
            p.cpu_s = stats[pid][2]
            if not p.vllm and len(self.cumulative) % MAPS_EVERY == 0:  # maps are long: seldom
                p.torch, p.vllm = _maps_flags(pid)
        self.live = live
        self.cumulative.append((time.monotonic() - self.t0,
                                sum(p.cpu_s for p in self.procs.values())))

    def report(self, total: float) -> str:
        by: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
        for p in self.procs.values():
            row = by[p.kind]
            row[0] += 1
            row[1] += p.cpu_s
            row[2] += p.torch
            row[3] += p.vllm
        seen = sum(r[1] for r in by.values())
        lines = [f"{'kind':<48} {'n':>4} {'CPU s':>8} {'share':>6} {'torch':>6} {'vLLM _C':>7}"]
        for kind, (n, cpu, t, v) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"{kind:<48} {n:>4} {cpu:>8.1f} {cpu / total:>6.1%} {t:>6} {v:>7}")
        lines.append(f"{'between readings':<48} {'':>4} {total - seen:>8.1f} "
                     f"{(total - seen) / total:>6.1%}")
        n = sum(r[0] for r in by.values())
        lines.append(f"{'all':<48} {n:>4} {total:>8.1f} {1:>6.1%} "
                     f"{sum(r[2] for r in by.values()):>6} {sum(r[3] for r in by.values()):>7}")
        lines.append(f"cores busy per {BUSY_BIN_S} s of wall (the tree's CPU seen; the host has "
                     f"{os.cpu_count()}): " + " ".join(f"{c:.1f}" for c in self.busy()))
        return "\n".join(lines)

    def report_modules(self, total: float, top: int = 30) -> str:
        modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # [all, the worker's]
        tests: dict[str, float] = defaultdict(float)
        for (test, in_worker), cpu in self.by_test.items():
            row = modules[test.split("::")[0]]
            row[0] += cpu
            row[1] += cpu * in_worker
            tests[test] += cpu
        lines = [f"{'test module':<56} {'CPU s':>8} {'share':>6} {'worker':>7}"]
        for module, (cpu, own) in sorted(modules.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"{module:<56} {cpu:>8.1f} {cpu / total:>6.1%} {own:>7.1f}")
        seen = sum(r[0] for r in modules.values())
        lines.append(f"{'between readings':<56} {total - seen:>8.1f} {(total - seen) / total:>6.1%}")
        lines.append(f"\nthe {top} costliest tests (CPU s, all processes; the worker's own):")
        for test, cpu in sorted(tests.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"{cpu:>7.1f} {self.by_test.get((test, True), 0.0):>7.1f}  {test}")
        for n, (pid, line) in enumerate(sorted(self.timeline.items())):
            lines.append(f"\nworker {n} (pid {pid}): module, from s to s")
            ends = [t for t, _ in line[1:]] + [self.cumulative[-1][0]]
            lines += [f"  {t:>6.0f} {end:>6.0f}  {module}" for (t, module), end in zip(line, ends)]
        return "\n".join(lines)

    def busy(self) -> list[float]:
        """The tree's CPU per BUSY_BIN_S of wall, in cores: where the run leaves a core idle
        (one pytest worker finishing alone, a start-up waiting on a port)."""
        out, t_edge, cpu_edge = [], BUSY_BIN_S, 0.0
        for (t, cpu), (t_next, _) in zip(self.cumulative, self.cumulative[1:] + [(1e18, 0)]):
            if t_next > t_edge:
                out.append((cpu - cpu_edge) / BUSY_BIN_S)
                t_edge, cpu_edge = t_edge + BUSY_BIN_S, cpu
        return out


def _is_worker(argv: list[str]) -> bool:
    return bool(argv) and argv[0].startswith("[pytest-xdist")


def _running(pid: int, stats: dict[int, tuple[int, int, float]],
             argvs: dict[int, list[str]]) -> str | None:
    """The test (node id) pid's nearest pytest-xdist ancestor (or pid itself) is running; None
    when no ancestor in the tree is a worker."""
    while pid in argvs:
        title = " ".join(argvs[pid][:1])
        if title.startswith("[pytest-xdist running] "):
            return title.split(" ", 2)[2]
        if title.startswith("[pytest-xdist"):
            return "(between tests)"
        pid = stats[pid][0]
    return None


def main() -> int:
    args = sys.argv[1:]
    split = args[0] if args and args[0] in ("--by-kind", "--by-test") else None
    if split:
        args = args[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not args:
        sys.exit(__doc__)
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")
    watcher = Watcher()
    if split:
        watcher.start()
    load = os.getloadavg()[0]
    t = time.monotonic()
    try:
        proc = subprocess.Popen(args)
    except OSError as e:  # not found, not executable: one line, as a shell says it
        sys.exit(f"tree_cpu: {args[0]}: {e.strerror}")
    rc, wall = 1, 0.0
    while True:  # each child reaped as it ends: the command, and the orphans re-parented here
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == proc.pid:
            rc = proc.returncode = os.waitstatus_to_exitcode(status)
            wall = time.monotonic() - t
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = r.ru_utime + r.ru_stime
    if split:
        watcher.stop.set()
        watcher.join()
        print(watcher.report(total) if split == "--by-kind" else watcher.report_modules(total),
              flush=True)
    print(f"tree_cpu: exit {rc}, wall {wall:.1f} s, CPU of the whole tree "
          f"{total:.1f} s (user {r.ru_utime:.1f} s, sys {r.ru_stime:.1f} s), "
          f"orphans reaped {time.monotonic() - t - wall:.1f} s after, load at start {load:.2f}",
          flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
