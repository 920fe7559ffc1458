"""Label-free recalibration under covariate shift (docs/METHOD.md section 13), measured offline on
a job's trajectories: where the weighted lambda* keeps the stop error within delta and where the
assumption (the loss given the gate features unchanged) fails.

    python benchmarks/bench_reweight.py --job runs/toy --family shifted=runs/toy/trajectories-shifted
    python benchmarks/bench_reweight.py --job runs/long \\
        --family shifted=runs/long/trajectories-shifted --family hard=runs/long/trajectories-hard

Families: `in-dist` (the job's test split: the control), each `--family` set, and each mixed
half and half with the test split (`in-dist+NAME`: traffic that overlaps the calibration set).
Per repetition, a family's traces are split at random into a traffic half, whose gate features
alone (no label) fit the density ratio against the job's training split, and a held-out half,
whose solvable traces give the realized stop error and token savings. The unweighted lambda* is
the job's bundle's; the weighted one is LTT on the calibration traces rejection sampling kept
(`orca_method.covariate_shift`, the code `orca-calibrate reweight` runs).

The assumption check: at the unweighted lambda*, the weighted calibration estimate of the risk
(sum of w_i L_i over sum of w_i, solvable calibration traces) against the family's realized
risk. Under covariate shift with the right weights they agree up to noise; a gap far beyond
noise means P(loss | features) differs between the calibration set and the family.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy.stats import binomtest

from orca_calibrate.reweight import features_of, gate_steps
from orca_method.bundle import load_bundle
from orca_method.covariate_shift import fit_density_ratio, resample, weighted_calibrate
from orca_method.ltt import default_grid
from orca_method.procedure import replay
from orca_method.risk import is_solvable, losses, stop_indices
from orca_method.stop_metrics import summarize
from orca_method.trajectories import TrajectorySet


class Pool:
    """Traces with gate features: features [n, d], smoothed scores, cumulative labels, step
    tokens, and which are solvable (those the stop risk is about)."""

    def __init__(self, ts: TrajectorySet, members: list[int], bundle, steps: int) -> None:
        idx, self.x = features_of(ts, members, steps)
        runs = replay(bundle.load_probe(), [ts.embeddings(i) for i in idx], bundle.window)
        self.scores = [s.numpy().astype(np.float64) for _, s in runs]
        self.labels = [ts.labels(i, bundle.label_mode) for i in idx]
        self.tokens = [np.asarray(ts.problems[i].step_tokens) for i in idx]
        self.solvable = np.array([is_solvable(c) for c in self.labels])

    def __len__(self) -> int:
        return len(self.scores)

    def outcome(self, rows: np.ndarray, lam: float) -> tuple[float, int, int, float]:
        """(error, losses, n, token savings) of the solvable traces among `rows` at `lam`."""
        rows = rows[self.solvable[rows]]
        s, c, k = ([v[i] for i in rows] for v in (self.scores, self.labels, self.tokens))
        tau = stop_indices(s, np.array([lam]))[0]
        out = summarize(tau, np.array([len(x) for x in s]), c, k)
        return out.error, int(round(out.error * len(rows))), len(rows), out.token_savings_total


def concat(a: Pool, b: Pool) -> Pool:
    out = Pool.__new__(Pool)
    out.x = np.vstack([a.x, b.x])
    out.scores, out.labels, out.tokens = a.scores + b.scores, a.labels + b.labels, \
        a.tokens + b.tokens
    out.solvable = np.concatenate([a.solvable, b.solvable])
    return out


def measure(name: str, fam: Pool, ref: np.ndarray, cal: Pool, bundle, reps: int,
            seed: int) -> list[dict]:
    deltas = bundle.deltas()
    lam_u = [bundle.lam(d) for d in deltas]
    sol = np.flatnonzero(cal.solvable)
    cal_loss_u = losses(stop_indices([cal.scores[i] for i in sol], np.array(lam_u)),
                        [cal.labels[i] for i in sol])  # [n_deltas, n_solvable]
    per: dict[str, list] = {k: [] for k in ("err_u", "err_w", "tok_u", "tok_w", "lam_w",
                                             "n_eff", "n_kept", "mean_w", "bound", "est_u")}
    rng = np.random.default_rng(seed)
    for r in range(reps):
        order = rng.permutation(len(fam))
        traffic, held = order[:len(fam) // 2], order[len(fam) // 2:]
        ratio = fit_density_ratio(ref, fam.x[traffic], seed=r)
        rs = resample(ratio, cal.x, np.vstack([ref, fam.x[traffic]]), seed=r)
        kept = rs.kept[sol]
        res = weighted_calibrate([cal.scores[i] for i in sol], [cal.labels[i] for i in sol],
                                 kept, deltas, epsilon=bundle.ltt.epsilon,
                                 grid=default_grid(bundle.ltt.grid_size))
        w = rs.weights[sol]
        out_u = [fam.outcome(held, lam) for lam in lam_u]
        out_w = [fam.outcome(held, x.lam) for x in res]
        per["err_u"].append([o[0] for o in out_u])
        per["err_w"].append([o[0] for o in out_w])
        per["tok_u"].append([o[3] for o in out_u])
        per["tok_w"].append([o[3] for o in out_w])
        per["lam_w"].append([x.lam for x in res])
        per["est_u"].append((cal_loss_u * w).sum(axis=1) / w.sum())
        per["n_eff"].append(rs.n_eff)
        per["n_kept"].append(int(kept.sum()))
        per["mean_w"].append(float(rs.weights.mean()))
        per["bound"].append(rs.bound)
    a = {k: np.asarray(v, dtype=float) for k, v in per.items()}
    all_rows = np.arange(len(fam))
    rows = []
    for j, d in enumerate(deltas):
        err_all, k, n, _ = fam.outcome(all_rows, lam_u[j])
        ci = binomtest(k, n).proportion_ci(0.95, method="exact")
        lw = a["lam_w"][:, j]
        rows.append({
            "family": name, "delta": d, "n_family": len(fam), "n_solvable": int(fam.solvable.sum()),
            "reps": reps, "lam_u": lam_u[j], "err_u_all": err_all,
            "err_u_all_ci95": [ci.low, ci.high],
            "err_u": a["err_u"][:, j].mean(), "err_w": a["err_w"][:, j].mean(),
            "err_w_sd": a["err_w"][:, j].std(), "over_w": (a["err_w"][:, j] > d).mean(),
            "over_u": (a["err_u"][:, j] > d).mean(),
            "tok_u": a["tok_u"][:, j].mean(), "tok_w": a["tok_w"][:, j].mean(),
            "lam_w_median": float(np.median(np.where(np.isinf(lw), 1.0, lw))),
            "never_w": float(np.isinf(lw).mean()), "est_u": a["est_u"][:, j].mean(),
            "n_eff": a["n_eff"].mean(), "n_kept": a["n_kept"].mean(),
            "mean_w": a["mean_w"].mean(), "bound_median": float(np.median(a["bound"])),
            "n_cal": len(cal), "n_cal_solvable": int(cal.solvable.sum())})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", required=True, help="the job directory (bundle.json, trajectories/)")
    ap.add_argument("--family", action="append", default=[], metavar="NAME=TRAJECTORIES")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args(argv)
    job = Path(a.job)
    bundle = load_bundle(job / "bundle.json")
    ts = TrajectorySet.open(job / "trajectories")
    steps = gate_steps(bundle)
    _, ref = features_of(ts, ts.split("train"), steps)
    cal = Pool(ts, ts.split("calibration"), bundle, steps)
    test = Pool(ts, ts.split("test"), bundle, steps)
    families = {"in-dist": test}
    for spec in a.family:
        name, path = spec.split("=", 1)
        other = TrajectorySet.open(path)
        families[name] = Pool(other, list(range(len(other))), bundle, steps)
        families[f"in-dist+{name}"] = concat(test, families[name])
    rows = []
    for name, fam in families.items():
        rows += measure(name, fam, ref, cal, bundle, a.reps, a.seed)
    print(f"job {job}: n_ref {len(ref)}, n_cal {len(cal)} ({int(cal.solvable.sum())} solvable), "
          f"gate steps {steps}, epsilon {bundle.ltt.epsilon}, {a.reps} traffic/held-out splits")
    print("| family | delta | unweighted lambda* | its error on the family (all, 95%) | on the "
          "held-out halves | weighted lambda* (median; never) | its error on the held-out "
          "halves (mean, sd; share > delta) | tokens saved unweighted / weighted | n_eff | kept "
          "| mean weight | weighted estimate of the unweighted's risk |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["err_u_all_ci95"]
        print(f"| {r['family']} | {r['delta']:g} | {r['lam_u']:.3f} | {r['err_u_all']:.3f} "
              f"({lo:.3f}-{hi:.3f}; n {r['n_solvable']}) | {r['err_u']:.3f} | "
              f"{r['lam_w_median']:.3f}; {r['never_w']:.2f} | {r['err_w']:.3f} "
              f"({r['err_w_sd']:.3f}; {r['over_w']:.2f}) | {r['tok_u']:.3f} / {r['tok_w']:.3f} | "
              f"{r['n_eff']:.0f} | {r['n_kept']:.0f} | {r['mean_w']:.3f} | {r['est_u']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
