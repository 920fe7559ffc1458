"""Our default meta-training vs the paper's protocol, over seeds, on one trajectory set.

Usage: python benchmarks/bench_training_protocol.py [--arms default paper ...] [--seeds 0 1 2]
       [--data DIR] [--window K] [--deltas 0.05 0.1 0.2]

Without --data (or with a folder that holds no set yet) a synthetic set is generated; an existing
trajectory directory (e.g. a calibration job's `runs/toy/trajectories`) is used as it is.

Each arm is a set of `meta_train` settings. Per (arm, seed): train on the train split, measure
the outer loss on the test split's solvable problems, choose lambda* by LTT on the calibration
split (window --window, epsilon 0.05, binomial p-values: the server's procedure), then report on the
test split at each delta both savings definitions (`savings_per_problem` = the paper's,
`savings_total_steps` = ratio of means) and the realized error. Results are cached per
(arm, seed) in OUT/results.json, so a rerun only trains what is missing; the summary table
(mean +- sd over seeds) is printed as markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from orca_calibrate.calibrate import GRID_SIZE, run_ltt, score_split
from orca_calibrate.synth import generate
from orca_calibrate.train import (
    DEFAULTS,
    Loader,
    lr_for_batch,
    meta_train,
    outer_loss,
    save_probe,
    solvable,
    unroll_scores,
)
from orca_method.ltt import calibrate, default_grid
from orca_method.probe import ProbeSpec
from orca_method.stop_metrics import stop_indices, summarize
from orca_method.trajectories import TrajectorySet

# The paper's protocol: batch 1, Adam lr 1e-3, 20 epochs (no-QK), the last epoch.
PAPER = {"batch_size": 1, "lr": 1e-3, "epochs": 20, "epoch_select": "last", "warmup": 0.0}
ARMS: dict[str, dict] = {
    "default": dict(DEFAULTS),
    "paper": PAPER,
    "b32-lr1e-3-val": {**PAPER, "batch_size": 32, "epoch_select": "validation"},  # the old default
    "b32-lr1e-3": {**PAPER, "batch_size": 32},
    "b32-lr3e-3": {**PAPER, "batch_size": 32, "lr": 3e-3},
    "b32-lr1e-2": {**PAPER, "batch_size": 32, "lr": 1e-2},
    "b32-lr3e-2": {**PAPER, "batch_size": 32, "lr": 3.2e-2},
    "b32-lr1e-2-val": {**PAPER, "batch_size": 32, "lr": 1e-2, "epoch_select": "validation"},
    "b32-lr1e-2-warm": {**PAPER, "batch_size": 32, "lr": 1e-2, "warmup": 0.1},
    "b32-lr1e-2-e30": {**PAPER, "batch_size": 32, "lr": 1e-2, "epochs": 30},
    "b32-lr5.7e-3": {**PAPER, "batch_size": 32, "lr": 5.7e-3},
    "default-val": {**DEFAULTS, "epoch_select": "validation"},
    "paper-val": {**PAPER, "epoch_select": "validation"},
}
DELTAS = [0.05, 0.1, 0.2]
RESPLITS = 200
EPSILON = 0.05
WINDOW = 10


def test_loss(probe, ts: TrajectorySet) -> float:
    """Outer loss (mean over problems of the per-step Brier loss) on the test split."""
    idx = solvable(ts, ts.split("test"), "supervised")
    loader = Loader(ts, "supervised", 64, cache_gram=False)
    with torch.no_grad():
        tot = sum(outer_loss(unroll_scores(probe, b.phi, b.mask), b).item() * len(b.phi)
                  for b in (loader.load(idx[i:i + 64]) for i in range(0, len(idx), 64)))
    return tot / len(idx)


def resplit(probe, ts: TrajectorySet, window: int, deltas: list[float],
            n_splits: int = RESPLITS) -> dict:
    """Mean metrics over random halvings of the pooled calibration + test problems.

    One calibration draw of ~175 problems moves lambda* in coarse steps (and the savings with
    it); averaging over many draws leaves the difference that the probe itself makes.
    """
    cal = score_split(probe, ts, "calibration", "supervised", window)
    test = score_split(probe, ts, "test", "supervised", window)
    scores, labels = cal.scores + test.scores, cal.labels + test.labels
    rng = np.random.default_rng(0)  # the same halvings for every probe: a paired comparison
    rows: dict[str, list[dict]] = {f"{d:g}": [] for d in deltas}
    for _ in range(n_splits):
        perm = rng.permutation(len(scores))
        c, t = perm[:len(perm) // 2], perm[len(perm) // 2:]
        for r in calibrate([scores[i] for i in c], [labels[i] for i in c], deltas,
                           epsilon=EPSILON, grid=default_grid(GRID_SIZE)):
            tau = stop_indices([scores[i] for i in t], np.array([r.lam]))[0]
            m = summarize(tau, np.array([len(scores[i]) for i in t]), [labels[i] for i in t])
            rows[f"{r.delta:g}"].append(m.__dict__)
    return {d: {k: float(np.mean([x[k] for x in v])) for k in ("savings_per_problem",
                                                              "savings_total_steps", "error")}
            for d, v in rows.items()}


def run_one(ts: TrajectorySet, settings: dict, seed: int, probe_file: Path, window: int,
            deltas: list[float]) -> dict:
    t0 = time.perf_counter()
    res = meta_train(ts, ProbeSpec(dim=ts.dim), "supervised", seed=seed, progress=False,
                     window=window, **settings)
    seconds = time.perf_counter() - t0
    save_probe(res.probe, probe_file, {"epoch": res.epoch})
    cal = score_split(res.probe, ts, "calibration", "supervised", window)
    test = score_split(res.probe, ts, "test", "supervised", window)
    lengths = np.array([len(s) for s in test.scores])
    out = {"train_seconds": seconds, "selected_epoch": res.epoch,
           "train_loss": res.history[-1]["train_loss"], "test_loss": test_loss(res.probe, ts),
           "n_cal": len(cal.ids), "deltas": {}, "resplit": resplit(res.probe, ts, window, deltas)}
    for r in run_ltt(cal, deltas, EPSILON, "binomial"):
        tau = stop_indices(test.scores, np.array([r.lam]))[0]
        m = summarize(tau, lengths, test.labels, test.tokens)
        out["deltas"][f"{r.delta:g}"] = {"lambda": r.lam, **m.__dict__}
    return out


def summary(results: dict, arms: list[str], seeds: list[int], deltas: list[float],
            source: str = "deltas") -> str:
    """Mean +- sd over seeds; `source` "deltas" (the fixed split) or "resplit" (averaged)."""
    def ms(xs: list[float], f: str = ".3f") -> str:
        return f"{np.mean(xs):{f}} ± {np.std(xs, ddof=1) if len(xs) > 1 else 0:{f}}"

    head = ["arm", "settings", "test outer loss", "selected epoch"]
    for d in deltas:
        head += [f"δ={d:g}: savings_per_problem (paper)", "savings_total_steps", "error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        runs = [results[f"{arm}/{s}"] for s in seeds
                if source in results.get(f"{arm}/{s}", {})]
        if not runs:
            continue
        st = ARMS[arm]
        lr = lr_for_batch(st["batch_size"]) if st["lr"] is None else st["lr"]
        cells = [arm, f"batch {st['batch_size']}, lr {lr:.3g}, {st['epochs']} ep, "
                 f"{st['epoch_select']}" + (f", warmup {st['warmup']:g}" if st["warmup"] else ""),
                 ms([r["test_loss"] for r in runs], ".4f"),
                 "/".join(str(r["selected_epoch"]) for r in runs)]
        for d in deltas:
            rows = [r[source][f"{d:g}"] for r in runs]
            cells += [ms([x["savings_per_problem"] for x in rows]),
                      ms([x["savings_total_steps"] for x in rows]),
                      ms([x["error"] for x in rows])]
        lines.append("| " + " | ".join(cells) + f" |  <!-- n_seeds={len(runs)} -->")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".cache/bench-protocol-700")
    ap.add_argument("--out", default=".cache/bench-protocol-out")
    ap.add_argument("--problems", type=int, default=700)
    ap.add_argument("--steps", type=int, default=40, help="mean steps per problem")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--window", type=int, default=WINDOW, help="smoothing window (default 10)")
    ap.add_argument("--deltas", type=float, nargs="+", default=DELTAS)
    ap.add_argument("--arms", nargs="+", default=["default", "paper"], choices=sorted(ARMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--report-only", action="store_true", help="print the cached results only")
    a = ap.parse_args()
    torch.set_num_threads(1)  # the machine is shared; ratios are fairer on one core each
    data = Path(a.data)
    if not (data / "problems.jsonl").exists():
        generate(data, n_problems=a.problems, dim=a.dim, mean_steps=a.steps, seed=0,
                 splits=(0.4, 0.3, 0.3))
    ts = TrajectorySet.open(data)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "results.json"
    results = json.loads(cache.read_text()) if cache.exists() else {}
    for arm in a.arms:
        for seed in a.seeds:
            key = f"{arm}/{seed}"
            if a.report_only or (key in results and results[key]["settings"] == ARMS[arm]):
                continue
            results[key] = {"settings": ARMS[arm],
                            **run_one(ts, ARMS[arm], seed, out / "probes" / f"{arm}-{seed}.safetensors",
                                    a.window, a.deltas)}
            cache.write_text(json.dumps(results, indent=1))
            r = results[key]
            print(f"{key}: {r['train_seconds']:.0f} s, test loss {r['test_loss']:.4f}, "
                  f"savings_per_problem@0.1 {r['deltas']['0.1']['savings_per_problem']:.3f}, "
                  f"error@0.1 {r['deltas']['0.1']['error']:.3f}", flush=True)
    n_test = len(solvable(ts, ts.split("test"), "supervised"))
    n_train = len(solvable(ts, ts.split("train"), "supervised"))
    print(f"\n{data}: {len(ts.problems)} problems, d = {ts.dim}; {n_train} solvable "
          f"train, n_cal = {results[f'{a.arms[0]}/{a.seeds[0]}']['n_cal']}, n_test = {n_test}; "
          f"epsilon = {EPSILON}, window = {a.window}; seeds {a.seeds}; "
          f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}\n")
    print("Fixed split (LTT on the calibration split, metrics on the test split):\n")
    print(summary(results, a.arms, a.seeds, a.deltas))
    print(f"\nMean over {RESPLITS} random halvings of calibration + test (same halvings for "
          "every probe; runs made before probes were saved have none):\n")
    print(summary(results, a.arms, a.seeds, a.deltas, "resplit"))


if __name__ == "__main__":
    main()
