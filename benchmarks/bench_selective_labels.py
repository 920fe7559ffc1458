"""Selective labelling on a real job: probes per trajectory, wall time and the bundle's lambda*
and mu* against every-step labelling, side by side (issue 36, item 4).

`simulate` needs no engine: on a finished every-step job (its trajectories, probe and job
file) it replays the label stage with the recorded answers standing in for the engine (an
every-step record holds the answer probed at every step), writes the labels it would have kept
into a copy of the set, calibrates both with the job's settings and compares the bundles' tables.

`run` runs a job (default: the long reasoner's) on the first --n of its prompts (its shifted
prompts dropped: they are labelled at every step either way) with `collect.label_steps` set to
--mode, into OUT/MODE; `compare` reads both runs and says whether they collected the same
trajectories (ids, step tokens, embeddings), certified the same thresholds (every row of the LTT
and give-up tables), and what each labelling cost (answer probes and stage times).

Usage (each `run` starts vLLM: under the shared lock on a shared machine):
  python benchmarks/bench_selective_labels.py run --mode every [--job J] [--n 200] [--out DIR]
      [--schedule pipelined|batches]
  python benchmarks/bench_selective_labels.py run --mode selective [...]
  python benchmarks/bench_selective_labels.py compare [--out DIR]
  python benchmarks/bench_selective_labels.py simulate --run runs/long [--job J] [--out DIR]
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
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orca_calibrate.collect import SCHEDULES  # noqa: E402
from orca_calibrate.job import load_job, run_job  # noqa: E402
from orca_method.bundle import load_bundle  # noqa: E402
from orca_method.trajectories import TrajectorySet  # noqa: E402

MODES = ("every", "selective")


def run(job_file: Path, n: int, mode: str, out: Path, schedule: str | None) -> None:
    job = load_job(job_file)  # paths made absolute
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    lines = Path(job["prompts"]).read_text().splitlines()[:n]
    prompts.write_text("\n".join(lines) + "\n")
    job.pop("shifted_prompts", None)
    job.update(prompts=str(prompts), out=str(out / mode))
    job["collect"] = {**(job.get("collect") or {}), "label_steps": mode,
                      **({"schedule": schedule} if schedule else {})}
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


def stop_side_probes(ts: TrajectorySet, members: list[int], probe, window: int, every: int,
                     grid: np.ndarray) -> float:
    """Probes per trace that settle the stop side alone on `grid` (no give-up block): the
    whole grid, or the part of it fixed-sequence testing looks at (lambda >= a floor)."""
    from orca_method.labels import fill_pessimistic, step_labels
    from orca_method.procedure import replay
    from orca_method.selective import deciding_steps, next_round

    runs = replay(probe, [ts.embeddings(i) for i in members], window=window)
    total = 0
    for (_, scores), i in zip(runs, members):
        p = ts.problems[i]
        modes = {"consistent": deciding_steps(scores.numpy().astype(np.float64), grid,
                                              label_every=every)}
        probed: dict[int, str | None] = {}
        while steps := next_round(modes, {"consistent": step_labels(
                fill_pessimistic(probed, p.n_steps), p.final_answer)}, probed):
            probed.update({t: p.step_answers[t] for t in steps})
        total += len(probed)
    return round(total / len(members), 2)


def simulate(run_dir: Path, job_file: Path, out: Path, floor: float | None) -> None:
    """The label stage on a finished every-step job, its recorded answers as the engine."""
    from orca_calibrate.calibrate import (
        GRID_SIZE,
        GiveUpOptions,
        calibrate_bundle,
        deciding_points,
    )
    from orca_method.ltt import default_grid
    from orca_calibrate.train import load_probe, train_give_up
    from orca_method.labels import fill_pessimistic, step_labels
    from orca_method.selective import next_round
    from orca_method.trajectories import update_problems

    job = load_job(job_file)
    ca, tr = job.get("calibrate") or {}, job.get("train") or {}
    every = (job.get("collect") or {}).get("label_every", 1)
    ts = TrajectorySet.open(run_dir / "trajectories")
    probe, meta = load_probe(run_dir / "probe.safetensors")
    mode = meta["label_mode"]
    give_up = None
    if ca.get("give_up") is not None:
        opts = GiveUpOptions(**{k: tuple(v) if k == "deltas" else v
                                for k, v in ca["give_up"].items()})
        give_up = (train_give_up(ts, opts.label_mode, seed=tr.get("seed", 0)), opts)
    window = ca.get("window", 10)
    cal = ts.split("calibration")
    t0 = time.perf_counter()
    deciding = deciding_points(probe, ts, cal, mode=mode, window=window, label_every=every,
                               give_up=give_up)
    plan_s = time.perf_counter() - t0
    changes, probes, every_probes, rounds = {}, 0, 0, 0
    for i in cal:
        p = ts.problems[i]
        targets = {"consistent": p.final_answer, "supervised": p.answer}
        probed: dict[int, str | None] = {}
        k = 0
        while True:
            labels = {m: step_labels(fill_pessimistic(probed, p.n_steps), targets[m])
                      for m in deciding[p.id]}
            steps = next_round(deciding[p.id], labels, probed)
            if not steps:
                break
            probed.update({t: p.step_answers[t] for t in steps})
            k += 1
        rounds = max(rounds, k)
        probes += len(probed)
        every_probes += len(next(iter(deciding[p.id].values())).candidates)
        filled = fill_pessimistic(probed, p.n_steps)
        changes[p.id] = {"step_answers": filled,
                         "labels": {m: step_labels(filled, t) for m, t in targets.items()
                                    if m in p.labels},
                         "extra": {**(p.extra or {}), "selective": {
                             "probed": sorted(probed), "resolved": {
                                 "stop": mode, "give_up": give_up and give_up[1].label_mode}}}}
    copy = out / "simulated-trajectories"
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir(parents=True)
    for name in ("info.json", "problems.jsonl"):
        shutil.copy(run_dir / "trajectories" / name, copy / name)
    (copy / "embeddings.bin").symlink_to((run_dir / "trajectories" / "embeddings.bin").resolve())
    update_problems(copy, changes)
    settings = dict(mode=mode, deltas=ca.get("deltas", [0.05, 0.1, 0.15, 0.2]),
                    epsilon=ca.get("epsilon", 0.05), window=window)
    bundles = {
        name: calibrate_bundle(probe, TrajectorySet.open(d), out / f"{name}.json",
                               give_up=give_up, **settings)
        for name, d in (("every", run_dir / "trajectories"), ("selective", copy))}
    report = {
        "run": str(run_dir), "n_cal_traces": len(cal), "n_cal": {
            k: b.ltt.n_cal for k, b in bundles.items()},
        "probes_per_trajectory": round(probes / len(cal), 2),
        "every_step_probes_per_trajectory": round(every_probes / len(cal), 2),
        "probe_share": round(probes / every_probes, 3), "rounds": rounds,
        "deciding_points_s": round(plan_s, 2),
        "stop_side_only_probes_per_trajectory": None if mode != "consistent" else
        stop_side_probes(ts, cal, probe, window, every, default_grid(GRID_SIZE)),
        "lambda_floor": floor,
        "stop_side_above_floor_probes_per_trajectory": None if floor is None or
        mode != "consistent" else stop_side_probes(ts, cal, probe, window, every,
                                                   default_grid(GRID_SIZE)[
                                                       default_grid(GRID_SIZE) >= floor]),
        "ltt_equal": bundles["every"].ltt == bundles["selective"].ltt,
        "give_up_equal": (bundles["every"].give_up is None or
                          bundles["every"].give_up.ltt == bundles["selective"].give_up.ltt),
        "lambda": {r.delta: r.lam for r in bundles["selective"].ltt.rows},
        "mu": None if give_up is None else {
            r.delta: r.mu for r in bundles["selective"].give_up.ltt.rows}}
    (out / "simulate.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["run", "compare", "simulate"])
    ap.add_argument("--run", help="simulate: a finished every-step job's out folder")
    ap.add_argument("--lambda-floor", type=float, help="simulate: also the stop side's probes "
                    "on the grid above this threshold only (e.g. the first one that fails for "
                    "the largest delta: what fixed-sequence testing looks at; no certificate)")
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--job", default=str(ROOT / "orca_calibrate" / "jobs" / "long.yaml"))
    ap.add_argument("--n", type=int, default=200, help="prompts (the job's first n)")
    ap.add_argument("--schedule", choices=SCHEDULES, help="run: the collection's schedule "
                    "(default: the job's); both modes of one comparison need the same")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-selective"))
    a = ap.parse_args()
    if a.what == "run":
        if a.mode is None:
            ap.error("run needs --mode")
        run(Path(a.job), a.n, a.mode, Path(a.out).resolve(), a.schedule)
    elif a.what == "simulate":
        if a.run is None:
            ap.error("simulate needs --run")
        simulate(Path(a.run), Path(a.job), Path(a.out), a.lambda_floor)
    else:
        compare(Path(a.out))


if __name__ == "__main__":
    main()
