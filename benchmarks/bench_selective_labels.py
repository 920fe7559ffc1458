"""Selective labelling on a real job: probes per trajectory, wall time and the bundle's lambda*
and mu* against every-step labelling, side by side (issue 36, item 4).

`run` runs a job (default: the long reasoner's) on the first --n of its prompts (its shifted
prompts dropped: they are labelled at every step either way) with `collect.label_steps` set to
--mode, into OUT/MODE; `compare` reads both runs and says whether they collected the same
trajectories (ids, step tokens, embeddings), certified the same thresholds (every row of the LTT
and give-up tables), and what each labelling cost (answer probes and stage times).

Usage (each `run` starts vLLM: under the shared lock on a shared machine):
  python benchmarks/bench_selective_labels.py run --mode every [--job J] [--n 200] [--out DIR]
  python benchmarks/bench_selective_labels.py run --mode selective [...]
  python benchmarks/bench_selective_labels.py compare [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orca_calibrate.job import load_job, run_job  # noqa: E402
from orca_method.bundle import load_bundle  # noqa: E402
from orca_method.trajectories import TrajectorySet  # noqa: E402

MODES = ("every", "selective")


def run(job_file: Path, n: int, mode: str, out: Path) -> None:
    job = load_job(job_file)  # paths made absolute
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    lines = Path(job["prompts"]).read_text().splitlines()[:n]
    prompts.write_text("\n".join(lines) + "\n")
    job.pop("shifted_prompts", None)
    job.update(prompts=str(prompts), out=str(out / mode))
    job["collect"] = {**(job.get("collect") or {}), "label_steps": mode}
    path = out / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    log = run_job(path)
    wall = time.perf_counter() - t0
    (out / mode / "wall.json").write_text(json.dumps({
        "wall_s": round(wall, 1), "stages": log, "prompts": len(lines),
        "load_start": load0, "load_end": os.getloadavg()[0],
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    print(f"{mode}: {wall:.0f} s, {log}")


def same_trajectories(a: TrajectorySet, b: TrajectorySet) -> dict[str, int]:
    ib, differ = {p.id: i for i, p in enumerate(b.problems)}, 0
    for i, p in enumerate(a.problems):
        j = ib.get(p.id)
        if j is None or p.step_tokens != b.problems[j].step_tokens or \
                not np.array_equal(a.embeddings(i), b.embeddings(j)):
            differ += 1
    return {"n": len(a), "n_other": len(b), "differ": differ}


def probes(d: Path, ts: TrajectorySet) -> dict[str, float]:
    collect = json.loads((d / "collect-stats.json").read_text())
    label = json.loads((d / "label-stats.json").read_text()) if (d / "label-stats.json").exists() \
        else None
    cal = ts.split("calibration")
    if label is None:  # every step of every trajectory (label_every 1)
        cal_probes = sum(ts.problems[i].n_steps for i in cal)
    else:
        cal_probes = label["answer_probes"]
    total = collect["answer_probes"] + (label["answer_probes"] if label else 0)
    return {"trajectories": len(ts), "calibration": len(cal), "probes_total": total,
            "probes_per_trajectory": round(total / len(ts), 2),
            "calibration_probes_per_trajectory": round(cal_probes / len(cal), 2),
            "calibration_steps_per_trajectory": round(
                sum(ts.problems[i].n_steps for i in cal) / len(cal), 2),
            "label_rounds": label["rounds"] if label else 0,
            "collect_probe_s": collect["probe_s"], "collect_generate_s": collect["generate_s"],
            "label_probe_s": label["probe_s"] if label else 0.0}


def compare(out: Path) -> None:
    runs = {m: out / m for m in MODES}
    sets = {m: TrajectorySet.open(d / "trajectories") for m, d in runs.items()}
    bundles = {m: load_bundle(d / "bundle.json") for m, d in runs.items()}
    rows = {m: [(r.delta, r.lam, r.risk, r.pvalue, r.savings) for r in b.ltt.rows]
            for m, b in bundles.items()}
    give_up = {m: None if b.give_up is None else
               [(r.delta, r.mu, r.risk, r.pvalue, r.give_up_rate) for r in b.give_up.ltt.rows]
               for m, b in bundles.items()}
    report = {
        "trajectories": same_trajectories(sets["every"], sets["selective"]),
        "n_cal": {m: b.ltt.n_cal for m, b in bundles.items()},
        "ltt_equal": rows["every"] == rows["selective"],
        "give_up_equal": give_up["every"] == give_up["selective"],
        "lambda": {m: {r.delta: r.lam for r in b.ltt.rows} for m, b in bundles.items()},
        "mu": {m: None if b.give_up is None else {r.delta: r.mu for r in b.give_up.ltt.rows}
               for m, b in bundles.items()},
        "probes": {m: probes(d, sets[m]) for m, d in runs.items()},
        "wall": {m: json.loads((d / "wall.json").read_text()) for m, d in runs.items()},
    }
    (out / "compare.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["run", "compare"])
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--job", default=str(ROOT / "orca_calibrate" / "jobs" / "long.yaml"))
    ap.add_argument("--n", type=int, default=200, help="prompts (the job's first n)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-selective"))
    a = ap.parse_args()
    if a.what == "run":
        if a.mode is None:
            ap.error("run needs --mode")
        run(Path(a.job), a.n, a.mode, Path(a.out))
    else:
        compare(Path(a.out))


if __name__ == "__main__":
    main()
