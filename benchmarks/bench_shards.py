"""Data-parallel collection on a real job's collection settings: one engine against N engine
processes (a shard of the prompts each, orca_calibrate/shards.py), side by side in one run
(issue 36, item 1).

Collects the first --n prompts of the job (default: the long reasoner's) twice, with its
`collect` block as it is, and reports each way's wall time (engine starts included), traces,
generated tokens and answer probes per second of it (`*_per_wall_s`), whether the N-engine set
is complete and in the job's order, and how many traces are the same as the one engine's (ids
and step tokens; and embeddings bit for bit).

`bundles` (no engine) runs the rest of the job (split, train, calibrate; its shifted and group
prompts dropped) on each collected set and reports lambda* per delta of each bundle; with
--probe (a probe trained elsewhere, e.g. the full job's) also lambda* with that one probe on
all of each set's traces, and the spread of lambda* over bootstrap resamples of the one-engine
set: how far two independent draws of this size fall apart, against which to read the two
engines' difference (sampled traces differ by design: orca_calibrate/shards.py).

Usage (collecting starts vLLM: under the shared lock on a shared machine):
  python benchmarks/bench_shards.py [--job J] [--n 48] [--engines 2] [--out DIR]
  python benchmarks/bench_shards.py bundles [--job J] [--out DIR] [--probe P] [--boot 200]
  python benchmarks/bench_shards.py resume [--job J] [--n 32] [--engines 2] [--kill-after 120]

`resume` (starts vLLM) kills an N-engine collection of the first --n prompts (the parent and
its engine processes, at once) --kill-after seconds in, counts what each shard had written,
then collects again: the set completes, the traces written before the kill kept as they were.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orca_calibrate.collect import Collector, CollectSettings, read_prompts  # noqa: E402
from orca_calibrate.job import TRAJECTORIES, load_job, run_job, stage_settings  # noqa: E402
from orca_calibrate.shards import collect_shards  # noqa: E402
from orca_method.trajectories import TrajectorySet  # noqa: E402


SETS = ("one", "two")  # the one engine's set and the sharded one's, in --out


def job_bundle(job_file: Path, trajectories: Path, out: Path) -> dict[float, float]:
    """Split, train and calibrate `trajectories` as the job would (its shifted and group prompts
    dropped: this compares the main table), in `out`; lambda* per delta of the bundle."""
    from orca_method.bundle import load_bundle

    job = load_job(job_file)
    for k in ("shifted_prompts", "group_prompts"):
        job.pop(k, None)
    (job.get("calibrate") or {}).pop("groups", None)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ts = TrajectorySet.open(trajectories)
    ids = {p.id for p in ts.problems}
    lines = [line for line in Path(job["prompts"]).read_text().splitlines()
             if json.loads(line)["id"] in ids]
    (out / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    job.update(prompts=str(out / "prompts.jsonl"), out=str(out))
    path = out / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    shutil.copytree(trajectories, out / TRAJECTORIES)
    # collected already: recorded as the collect stage would, so the job starts no engine
    (out / ".done-collect").write_text(json.dumps(
        {"settings": stage_settings(load_job(path))["collect"], "finished": "bench_shards"}))
    print(run_job(path, progress=False), flush=True)
    bundle = load_bundle(out / "bundle.json")
    return {"n_cal": bundle.ltt.n_cal, **{r.delta: r.lam for r in bundle.ltt.rows}}


def fixed_probe(job_file: Path, sets: dict[str, Path], probe_file: Path, boot: int,
                seed: int = 0) -> dict:
    """lambda* per delta with one probe on all of each set's traces, and its spread over
    `boot` bootstrap resamples of the first set's (what two independent draws of this size
    give)."""
    from orca_calibrate.calibrate import run_ltt, score_split
    from orca_calibrate.train import load_probe

    job = load_job(job_file)
    ca = job.get("calibrate") or {}
    deltas, eps, window = ca.get("deltas", [0.05, 0.1, 0.15, 0.2]), ca.get("epsilon", 0.05), \
        ca.get("window", 10)
    probe, meta = load_probe(probe_file)
    scored = {k: score_split(probe, TrajectorySet.open(d), "all", meta["label_mode"], window)
              for k, d in sets.items()}
    report: dict = {"probe": str(probe_file), "n_cal": {k: len(s.ids) for k, s in scored.items()},
                    "lambda": {k: {r.delta: r.lam for r in run_ltt(s, deltas, eps, "binomial")}
                               for k, s in scored.items()}}
    base, rng = scored[next(iter(sets))], np.random.default_rng(seed)
    lams = []
    for _ in range(boot):
        pick = rng.integers(0, len(base.ids), len(base.ids))
        resample = type(base)(
            ids=[base.ids[i] for i in pick], scores=[base.scores[i] for i in pick],
            labels=[base.labels[i] for i in pick],
            tokens=None if base.tokens is None else [base.tokens[i] for i in pick])
        lams.append([r.lam for r in run_ltt(resample, deltas, eps, "binomial")])
    arr = np.array(lams)  # (boot, deltas); inf where nothing is certified
    report["bootstrap"] = {"resamples": boot, "of": next(iter(sets)), **{
        d: {"uncertified": float(np.mean(~np.isfinite(arr[:, j]))),
            "q05_q50_q95": [round(float(q), 3) for q in
                            np.quantile(arr[np.isfinite(arr[:, j]), j], [0.05, 0.5, 0.95])]
            if np.isfinite(arr[:, j]).any() else None}
        for j, d in enumerate(deltas)}}
    return report


def job_cut(job_file: Path, n: int, **collect: object) -> tuple[dict, list, CollectSettings]:
    """The job, its first `n` prompts and its collect settings (`collect` overriding some): the
    long job cut to a size one locked run can collect (also bench_pipeline's)."""
    job = load_job(job_file)
    prompts = read_prompts(Path(job["prompts"]))[:n]
    return job, prompts, CollectSettings(**{**(job.get("collect") or {}), **collect})


def sharded_collection(job_file: Path, n: int, engines: int, out: Path):
    """The first `n` prompts of the job collected by `engines` engine processes into
    out/resume (shards in out/resume-work), as the job's collect stage does."""
    job, prompts, settings = job_cut(job_file, n, engines=engines)
    return collect_shards(job["model"], settings, [(prompts, out / "resume", set())],
                          out / "resume-work"), prompts


def resume(job_file: Path, n: int, engines: int, out: Path, kill_after: float) -> None:
    for d in ("resume", "resume-work"):
        shutil.rmtree(out / d, ignore_errors=True)
    argv = [sys.executable, __file__, "resume-child", "--job", str(job_file), "--n", str(n),
            "--engines", str(engines), "--out", str(out)]
    proc = subprocess.Popen(argv, start_new_session=True)  # its own group: engines die with it
    try:
        proc.wait(kill_after)
        killed = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = True
    before, per_shard = {}, []
    for i in range(engines):
        d = out / "resume-work" / f"shard-{i}" / "set-0"
        ts = TrajectorySet.open(d) if (d / "problems.jsonl").exists() else None
        before.update({p.id: p.step_tokens for p in ts.problems} if ts else {})
        per_shard.append(len(ts) if ts else 0)
    t0 = time.perf_counter()
    stats, prompts = sharded_collection(job_file, n, engines, out)
    merged = TrajectorySet.open(out / "resume")
    kept = sum(p.id in before and p.step_tokens == before[p.id] for p in merged.problems)
    order = [str(p["id"]) for p in prompts]
    report = {"prompts": n, "engines": engines, "killed_after_s": kill_after, "killed": killed,
              "written_before_kill": per_shard, "rerun_wall_s": round(time.perf_counter() - t0, 1),
              "rerun_collected": stats.trajectories, "merged": len(merged),
              "complete_in_order": [p.id for p in merged.problems] == order,
              "kept_unchanged": kept}
    (out / "resume.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def bundles(job_file: Path, out: Path, probe: Path | None, boot: int) -> None:
    sets = {k: out / k for k in SETS}
    report = {"job_bundles": {k: job_bundle(job_file, d, out / f"job-{k}")
                              for k, d in sets.items()}}
    if probe is not None:
        report["fixed_probe"] = fixed_probe(job_file, sets, probe, boot)
    (out / "bundles.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", choices=["collect", "bundles", "resume", "resume-child"],
                    default="collect")
    ap.add_argument("--job", default=str(ROOT / "orca_calibrate" / "jobs" / "long.yaml"))
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-shards"))
    ap.add_argument("--probe", help="bundles: also calibrate every trace of both sets with this "
                    "probe (e.g. the full job's probe.safetensors) and bootstrap the spread")
    ap.add_argument("--boot", type=int, default=200)
    ap.add_argument("--kill-after", type=float, default=120.0)
    a = ap.parse_args()
    if a.what == "resume":
        resume(Path(a.job), a.n, a.engines, Path(a.out).resolve(), a.kill_after)
        return
    if a.what == "resume-child":  # the collection `resume` kills
        sharded_collection(Path(a.job), a.n, a.engines, Path(a.out))
        return
    if a.what == "bundles":
        bundles(Path(a.job), Path(a.out).resolve(), a.probe and Path(a.probe), a.boot)
        return
    job, prompts, settings = job_cut(Path(a.job), a.n)
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
    same = [i for i, p in enumerate(two_set.problems)
            if p.id in index and p.step_tokens == one_set.problems[index[p.id]].step_tokens]
    bitwise = sum(np.array_equal(two_set.embeddings(i),
                                 one_set.embeddings(index[two_set.problems[i].id])) for i in same)
    report.update(complete=[p.id for p in two_set.problems] == [p.id for p in one_set.problems],
                  n_one=len(one_set), n_sharded=len(two_set), same_step_tokens=len(same),
                  same_embeddings_too=bitwise,
                  load_end=os.getloadavg()[0])
    for k, ts in (("one", one_set), ("sharded", two_set)):
        wall = report[k]["wall_s"]
        report[k].update(traces_per_wall_s=round(len(ts) / wall, 3),
                         tokens_per_wall_s=round(report[k]["generated_tokens"] / wall, 1),
                         probes_per_wall_s=round(report[k]["answer_probes"] / wall, 1))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
