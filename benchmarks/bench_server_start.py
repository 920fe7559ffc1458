"""What one `orca-serve --demo` start costs in CPU, per process, until /health answers.

`make test` starts about twenty servers; on a 2-core host its wall time is its CPU time over two
cores, so a start's CPU is what a server test pays before its first request. Read from /proc
(utime + stime of every process in the server's session) when /health first answers, so it
needs no profiler; the processes are named as vLLM titles them (VLLM::EngineCore,
VLLM::Worker).

Two engine layouts (`--layouts`):
- `cpu`: vLLM's CPU build as a user starts it: the API server, the EngineCore, and the worker
  in a process of its own (vLLM's CPU platform turns the single-process executor into "mp");
- `inproc`: VLLM_ENABLE_V1_MULTIPROCESSING=0, which the engine test modules set at import
  (tests/test_plugin.py and two more) and every server a pytest process starts afterwards
  inherits: the worker runs inside the EngineCore process, as a single-GPU vLLM server runs
  it.

    python benchmarks/bench_server_start.py [--n 2] [--layouts cpu inproc] [--out runs/x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests package's helpers

from tests.serving import Server, orca_serve_cmd

TICK = os.sysconf("SC_CLK_TCK")
LAYOUTS = {"cpu": None, "inproc": "0"}  # VLLM_ENABLE_V1_MULTIPROCESSING (None: unset)
ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def session_cpu(sid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each live process of session `sid`, by role."""
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) != sid:  # the session id, 6th field of stat
            continue
        role = ("api server" if int(pid) == sid else cmd if cmd.startswith("VLLM::")
                else "other")
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def one_start(layout: str, d: Path) -> dict:
    """One `orca-serve --demo` start in `layout`: wall seconds to /health and CPU by process."""
    value = LAYOUTS[layout]
    saved = os.environ.pop(ENV, None)
    if value is not None:
        os.environ[ENV] = value
    try:
        t = time.monotonic()
        srv = Server(orca_serve_cmd("--demo"), d / f"{layout}.log",
                     ["--host", "127.0.0.1", "--enforce-eager", "--seed", "0",
                      "--disable-uvicorn-access-log"])
    finally:
        os.environ.pop(ENV, None)
        if saved is not None:
            os.environ[ENV] = saved
    try:
        srv.wait()
        wall = time.monotonic() - t
        cpu = session_cpu(srv.proc.pid)
    finally:
        srv.stop()
    return {"layout": layout, "wall_s": round(wall, 1), "cpu_s": round(sum(cpu.values()), 1),
            "by_process": {k: round(v, 1) for k, v in sorted(cpu.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2, help="starts per layout (alternating)")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.n):
            for layout in args.layouts:  # alternating: the host's load drifts
                runs.append(one_start(layout, Path(tmp)))
                print(json.dumps(runs[-1]), flush=True)
    for layout in args.layouts:
        mine = [r for r in runs if r["layout"] == layout]
        cpu = statistics.median(r["cpu_s"] for r in mine)
        wall = statistics.median(r["wall_s"] for r in mine)
        print(f"{layout}: n={len(mine)} CPU median {cpu:.1f} s, wall median {wall:.1f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
