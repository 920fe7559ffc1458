"""Data-parallel collection on a real job's collection settings: one engine against N engine
processes (a shard of the prompts each, orca_calibrate/shards.py), side by side in one run
(issue 36, item 1).

Collects the first --n prompts of the job (default: the long reasoner's) twice, with its
`collect` block as it is, and reports each way's wall time (engine starts included), traces per
minute, whether the N-engine set is complete and in the job's order, and how many traces are
the same (ids, step tokens, embeddings) as the one engine's.

Usage (starts vLLM: under the shared lock on a shared machine):
  python benchmarks/bench_shards.py [--job J] [--n 48] [--engines 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orca_calibrate.collect import Collector, CollectSettings, read_prompts  # noqa: E402
from orca_calibrate.job import load_job  # noqa: E402
from orca_calibrate.shards import collect_shards  # noqa: E402
from orca_method.trajectories import TrajectorySet  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=str(ROOT / "orca_calibrate" / "jobs" / "long.yaml"))
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-shards"))
    a = ap.parse_args()
    job = load_job(Path(a.job))
    prompts = read_prompts(Path(job["prompts"]))[:a.n]
    settings = CollectSettings(**(job.get("collect") or {}))
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    report = {"prompts": len(prompts), "engines": a.engines, "cores": len(os.sched_getaffinity(0)),
              "load_start": os.getloadavg()[0]}
    t0 = time.perf_counter()
    with Collector(job["model"], settings) as one:
        s1 = one.run(prompts, out / "one", progress=False)
    report["one"] = {"wall_s": round(time.perf_counter() - t0, 1), **s1.as_dict()}
    t0 = time.perf_counter()
    sharded = CollectSettings(**{**settings.__dict__, "engines": a.engines})
    s2 = collect_shards(job["model"], sharded, [(prompts, out / "two", set())], out / "work")
    report["sharded"] = {"wall_s": round(time.perf_counter() - t0, 1), **s2.as_dict()}
    one_set, two_set = TrajectorySet.open(out / "one"), TrajectorySet.open(out / "two")
    index = {p.id: i for i, p in enumerate(one_set.problems)}
    same = sum(p.id in index and p.step_tokens == one_set.problems[index[p.id]].step_tokens
               and np.array_equal(two_set.embeddings(i), one_set.embeddings(index[p.id]))
               for i, p in enumerate(two_set.problems))
    report.update(complete=[p.id for p in two_set.problems] == [p.id for p in one_set.problems],
                  n_one=len(one_set), n_sharded=len(two_set), same_traces=same,
                  load_end=os.getloadavg()[0])
    for k, ts in (("one", one_set), ("sharded", two_set)):
        report[k]["traces_per_min"] = round(60 * len(ts) / report[k]["wall_s"], 2)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
