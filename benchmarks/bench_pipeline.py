"""Pipelined collection against the batch collector on a real job, side by side on one engine
(issue 36, item 2): traces/s, generated tokens/s, answer probes/s and wall time of each.

Collects the first --n prompts of the job (default: the long reasoner's; its shifted prompts
dropped) with its `collect` block as it is, once per schedule (`collect.schedule`), on one vLLM
engine (one start, not timed; its prefix cache emptied between the two), in the order given by
--order. The sampled traces are not the same between the two (docs/CALIBRATE.md, "No phase
barrier"), so each reports its own tokens and probes per trace; tokens/s is the figure that
compares like with like. Writes OUT/report.json after each schedule (a killed run keeps the
first).

Usage (starts vLLM: under the shared lock on a shared machine):
  python benchmarks/bench_pipeline.py [--job J] [--n 96] [--order batches,pipelined] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_shards import job_cut  # noqa: E402
from orca_calibrate.collect import SCHEDULES, Collector, Stats  # noqa: E402
from orca_method.trajectories import TrajectorySet  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=str(ROOT / "orca_calibrate" / "jobs" / "long.yaml"))
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--order", default="batches,pipelined")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-pipeline"))
    a = ap.parse_args()
    order = a.order.split(",")
    if sorted(order) != sorted(SCHEDULES):
        ap.error(f"--order names each of {', '.join(SCHEDULES)} once")
    job, prompts, settings = job_cut(Path(a.job), a.n)
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    report: dict = {"job": a.job, "prompts": len(prompts), "batch": settings.batch,
                    "temperature": settings.temperature, "order": order,
                    "cores": len(os.sched_getaffinity(0)),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with Collector(job["model"], settings) as collector:
        for schedule in order:
            collector.llm.reset_prefix_cache()  # the first run's prompts not cached for the second
            collector.settings = replace(settings, schedule=schedule)
            load0, t0 = os.getloadavg()[0], time.perf_counter()
            stats = collector.run(prompts, out / schedule, progress=False)
            wall = time.perf_counter() - t0
            ts = TrajectorySet.open(out / schedule)
            report[schedule] = {
                "wall_s": round(wall, 1), "load_start": load0, "load_end": os.getloadavg()[0],
                "traces": len(ts), "traces_per_s": round(len(ts) / wall, 3),
                "generated_tokens": stats.generated_tokens,
                "generated_tokens_per_s": round(stats.generated_tokens / wall, 1),
                "tokens_per_trace": round(stats.generated_tokens / len(prompts), 1),
                "answer_probes": stats.answer_probes,
                "answer_probes_per_s": round(stats.answer_probes / wall, 2),
                "probes_per_trace": round(stats.answer_probes / len(ts), 2),
                "stats": stats.as_dict()}
            collector.stats = Stats()  # each schedule's own counts
            (out / "report.json").write_text(json.dumps(report, indent=1))
    if all(s in report for s in SCHEDULES):
        report["pipelined_over_batches"] = {
            k: round(report["pipelined"][k] / report["batches"][k], 3)
            for k in ("traces_per_s", "generated_tokens_per_s", "answer_probes_per_s")}
        report["wall_s_ratio"] = round(report["pipelined"]["wall_s"] / report["batches"]["wall_s"], 3)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
