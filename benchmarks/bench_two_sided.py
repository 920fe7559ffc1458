"""Two-sided ORCA offline: tokens and accuracy of one-sided ORCA, two-sided ORCA and the oracles
on recorded toy trajectories, with both realized risks (n, 95% intervals).

Offline: the arms replay the deployed procedure (`orca_method.procedure`, the server's code)
over trajectories recorded by `orca-calibrate collect`, through
`orca_calibrate.evaluate.evaluate_two_sided`; tokens are reasoning tokens (a stop's forced answer
is not counted, the same for every arm). Two workloads:
- **demo bundle, shifted family**: the toy job's bundle (calibrated in-distribution, where 94% of
  the traces end right) on the toy's shifted family (runs/toy/trajectories-shifted, held out;
  made by `python -m orca_demo.toy.demo_bundle`). A distribution shift: no guarantee applies.
- **long reasoner**: its job's bundle (`python -m orca_demo.toy.demo_bundle --reasoner long`,
  in runs/long) on its job's test split (held out, in distribution: 26% of the traces are never
  right, the guarantees apply) and on its held-out shifted family (no guarantee applies).
- **hard workload**: a job of its own on fresh shifted-family prompts (RUN_PROMPTS, seed
  HARD_SEED, about half end with the right answer): collect, split 50/25/25, train, calibrate
  both thresholds on its calibration split, evaluate on its test split (held out, exchangeable:
  the guarantees apply).
  Collection runs the embedded model on CPU (about 2 minutes here); reruns reuse it.

Usage: python benchmarks/bench_two_sided.py [--skip-hard]
Writes runs/bench-two-sided/result.json and prints the markdown tables of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orca_calibrate.evaluate import evaluate_two_sided
from orca_calibrate.job import run_job
from orca_demo.toy.tasks import write_prompts
from orca_method.bundle import load_bundle
from orca_method.trajectories import TrajectorySet

HARD_SEED = 11  # the shifted family's job file uses seed 2
RUN_PROMPTS = 1200
OUT = ROOT / "runs" / "bench-two-sided"
DELTAS = (0.05, 0.1)
ARMS = ("full", "one_sided", "two_sided", "oracle_stop", "oracle_two_sided")


def hard_job(out: Path) -> Path:
    """The hard workload's job file (the toy job's settings, on shifted prompts)."""
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, "shifted", RUN_PROMPTS, HARD_SEED)
    job = yaml.safe_load((ROOT / "orca_calibrate" / "jobs" / "toy.yaml").read_text())
    job.pop("shifted_prompts", None)
    job.update(model=str(ROOT / "orca_serve" / "demo" / "model"), prompts=str(prompts),
               out=str(out / "run"))
    path = out / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def pct(x: float) -> str:
    return f"{x:.3f}"


def num(x: float | None) -> str:
    """A threshold as the table prints it: 3 significant digits, `never` for None (inf)."""
    return "never" if x is None else f"{x:.3g}"


def risk(r: dict[str, Any]) -> str:
    return f"{r['rate']:.3f} ({r['k']}/{r['n']}, {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f})"


def table(name: str, reports: list[dict[str, Any]]) -> str:
    lines = [f"**{name}** (n = {reports[0]['n']} traces, split `{reports[0]['split']}`)", "",
             "| delta | delta_2 | lambda* | mu* | arm | tokens/request | accuracy | best guess "
             "| ended early | gave up | stop error (k/n, 95%) | give-up error (k/n, 95%) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        for arm in ARMS:
            a = r["arms"][arm]
            lines.append(f"| {r['delta']:g} | {r['delta_2']:g} | {num(r['lambda'])} | {num(r['mu'])} | "
                         f"{arm} | {a['tokens_per_request']:.1f} | {pct(a['accuracy'])} | "
                         f"{pct(a['accuracy_best_guess'])} | {pct(a['ended_early'])} | "
                         f"{pct(a['gave_up'])} | {risk(a['stop_error'])} | "
                         f"{risk(a['give_up_error'])} |")
    return "\n".join(lines)


def sweep(bundle_path: Path, data: Path, split: str) -> list[dict[str, Any]]:
    bundle = load_bundle(bundle_path)
    ts = TrajectorySet.open(data)
    return [evaluate_two_sided(bundle, ts, split, delta=d, delta_2=d2)
            for d in DELTAS for d2 in bundle.give_up_deltas()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-hard", action="store_true", help="only the demo bundle's workload")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    toy = ROOT / "runs" / "toy"
    if (toy / "bundle.json").exists() and (toy / "trajectories-shifted").exists():
        result["demo_shifted"] = sweep(toy / "bundle.json", toy / "trajectories-shifted", "all")
        print(table("demo bundle, shifted family", result["demo_shifted"]), "\n")
    else:
        print("runs/toy is missing: run `python -m orca_demo.toy.demo_bundle` first")
    long = ROOT / "runs" / "long"
    if (long / "bundle.json").exists():
        result["long_test"] = sweep(long / "bundle.json", long / "trajectories", "test")
        print(table("long reasoner, in distribution (test split)", result["long_test"]), "\n")
        result["long_shifted"] = sweep(long / "bundle.json", long / "trajectories-shifted", "all")
        print(table("long reasoner, shifted family", result["long_shifted"]), "\n")
    else:
        print("runs/long is missing: run `python -m orca_demo.toy.demo_bundle --reasoner long`")
    if not a.skip_hard:
        job = hard_job(OUT / "hard")
        run_job(job, progress=False)
        run = OUT / "hard" / "run"
        result["hard"] = sweep(run / "bundle.json", run / "trajectories", "test")
        print(table("hard workload (shifted family, own calibration)", result["hard"]))
    (OUT / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
