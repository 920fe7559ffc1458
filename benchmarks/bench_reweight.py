"""Label-free recalibration under covariate shift (docs/METHOD.md section 13), measured offline on
a job's trajectories: where the weighted lambda* keeps the stop error within delta and where the
assumption (the loss given the gate features unchanged) fails.

    python benchmarks/bench_reweight.py --job runs/toy \\
        --family shifted=runs/toy/trajectories-shifted
    python benchmarks/bench_reweight.py --job runs/long \\
        --family shifted=runs/long/trajectories-shifted --family hard=runs/long/trajectories-hard

Families: `in-dist` (the job's test split: the control); two shifts of it: `in-dist tilted`
(the test split resampled towards a direction of the gate features along which the loss grows:
covariate shift by construction, the assumption exact) and `in-dist, answer late` (the test
split's problems whose answer lies further from the walk's start than the median, read off the
prompt: a shift a deployment could see, the assumption only as good as the features' view of
the prompt); each `--family` set; and each mixed half and half with the test split
(`in-dist+NAME`: traffic that overlaps the calibration set).
Per repetition, a family's traces are split at random into a traffic half, whose gate features
alone (no label) fit the density ratio against the job's training split, and a held-out half,
whose solvable traces give the realized stop error and token savings. Three arms: the job's
bundle's lambda* served without the gate, the same with the gate (a flagged trace runs in full:
the default safe action), and the weighted lambda* with the gate: LTT on the calibration traces
rejection sampling kept (`orca_calibrate.reweight.draw`, the code `orca-calibrate reweight`
runs: everything restricted to what the gate passes).

For a two-sided bundle a second table does the same for the give-up side: the bundle's mu*
without and with the gate (a flagged trace never gives up) and mu* recertified on the same kept
traces (all of them: the give-up risk is over every request), the give-up error over every
held-out trace under the bundle's give-up policy.

The assumption check: at the unweighted lambda*, the weighted calibration estimate of the risk
(sum of w_i L_i over sum of w_i, solvable calibration traces) against the family's realized
risk. Under covariate shift with the right weights they agree up to noise; a gap far beyond
noise means P(loss | features) differs between the calibration set and the family.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from orca_calibrate.reweight import draw, features_of, gate_passes, gate_steps
from orca_method.bundle import load_bundle
from orca_method.covariate_shift import CV_FOLDS, weighted_calibrate
from orca_method.give_up import (
    calibrate_give_up,
    gave_up,
    give_up_indices,
    give_up_losses,
    last_right,
    mu_grid,
)
from orca_method.ltt import default_grid
from orca_method.procedure import replay
from orca_method.risk import is_solvable, losses, stop_indices
from orca_method.stop_metrics import summarize
from orca_method.shift_gate import gate_features
from orca_method.thresholds import GIVE_UP_NEVER
from orca_method.trajectories import TrajectorySet


class Pool:
    """Traces with gate features: features [n, d], smoothed scores, cumulative labels, step
    tokens, and which are solvable (those the stop risk is about)."""

    def __init__(self, ts: TrajectorySet, members: list[int], bundle, steps: int) -> None:
        idx, self.x = features_of(ts, members, steps)
        self.passes = gate_passes(bundle, self.x)
        runs = replay(bundle.load_probe(), [ts.embeddings(i) for i in idx], bundle.window)
        self.scores = [s.numpy().astype(np.float64) for _, s in runs]
        self.labels = [ts.labels(i, bundle.label_mode) for i in idx]
        self.tokens = [np.asarray(ts.problems[i].step_tokens) for i in idx]
        self.solvable = np.array([is_solvable(c) for c in self.labels])
        self.give_up = last = None
        if bundle.give_up is not None:  # the give-up probe's smoothed scores, last right steps
            g = bundle.give_up
            runs = replay(bundle.load_give_up_probe(), [ts.embeddings(i) for i in idx], g.window)
            self.give_up = [s.numpy().astype(np.float64) for _, s in runs]
            last = np.array([last_right(ts.raw_labels(i, g.label_mode)) for i in idx])
        self.last = last

    def __len__(self) -> int:
        return len(self.scores)

    def outcome(self, rows: np.ndarray, lam: float, gated: bool = True
                ) -> tuple[float, int, int, float]:
        """(error, losses, n, token savings) of the solvable traces among `rows` served with
        `lam`; `gated`: those the gate flags run in full (the default safe action)."""
        rows = rows[self.solvable[rows]]
        s, c, k = ([v[i] for i in rows] for v in (self.scores, self.labels, self.tokens))
        lams = np.where(self.passes[rows] | (not gated), lam, np.inf)
        tau = np.array([stop_indices([m], np.array([x]))[0, 0] for m, x in zip(s, lams)])
        out = summarize(tau, np.array([len(x) for x in s]), c, k)
        return out.error, int(round(out.error * len(rows))), len(rows), out.token_savings_total


    def give_up_outcome(self, rows: np.ndarray, mu: float, policy, gated: bool = True
                        ) -> tuple[float, float]:
        """(give-up error, share given up) over every trace among `rows` with threshold `mu`;
        `gated`: a trace the gate flags never gives up."""
        mus = np.where(self.passes[rows] | (not gated), mu, GIVE_UP_NEVER)
        g = [self.give_up[i] for i in rows]
        tau = np.array([give_up_indices([x], np.array([m]))[0, 0] for x, m in zip(g, mus)])
        lengths = np.array([len(x) for x in g])
        loss = give_up_losses(tau[None], lengths, self.last[rows], policy)[0]
        return float(loss.mean()), float(gave_up(tau, lengths).mean())

    def take(self, rows: np.ndarray) -> Pool:
        """These traces (repeats allowed) as a pool of their own."""
        out = Pool.__new__(Pool)
        out.x, out.solvable, out.passes = self.x[rows], self.solvable[rows], self.passes[rows]
        out.scores, out.labels, out.tokens = ([v[i] for i in rows]
                                              for v in (self.scores, self.labels, self.tokens))
        out.give_up = None if self.give_up is None else [self.give_up[i] for i in rows]
        out.last = None if self.last is None else self.last[rows]
        return out


def concat(a: Pool, b: Pool) -> Pool:
    out = Pool.__new__(Pool)
    out.x = np.vstack([a.x, b.x])
    out.scores, out.labels, out.tokens = a.scores + b.scores, a.labels + b.labels, \
        a.tokens + b.tokens
    out.solvable = np.concatenate([a.solvable, b.solvable])
    out.passes = np.concatenate([a.passes, b.passes])
    out.give_up = None if a.give_up is None else a.give_up + b.give_up
    out.last = None if a.last is None else np.concatenate([a.last, b.last])
    return out


def answer_position(problem) -> int:
    """How far the reasoning walks before the answer, read off the prompt: the toy tries x =
    1, 2, ... (the answer itself), the long reasoner walks from its given start."""
    start = re.search(r"Start at x=(-?\d+)", problem.prompt or "")
    return int(problem.answer) - (int(start.group(1)) if start else 0)


def tilted(test: Pool, train: Pool, lam: float, beta: float, seed: int) -> Pool:
    """The test split resampled (with repeats, as many traces) with probability proportional to
    exp(beta s(x)), s a standardised direction of the gate features along which the stop loss
    at `lam` grows (a ridge fit on the training split's traces): a covariate shift by
    construction (the loss given x is untouched), chosen to hurt the unweighted lambda*."""
    sol = np.flatnonzero(train.solvable)
    loss = losses(stop_indices([train.scores[i] for i in sol], np.array([lam])),
                  [train.labels[i] for i in sol])[0].astype(float)  # [n]
    x = train.x[sol]
    mean = x.mean(axis=0)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    z = (x - mean) @ vt[:16].T  # [n, 16]
    coef = np.linalg.solve(z.T @ z + 1e-3 * len(z) * np.eye(z.shape[1]), z.T @ (loss - loss.mean()))
    s_train = z @ coef
    s = ((test.x - mean) @ vt[:16].T @ coef - s_train.mean()) / s_train.std()  # [m]
    p = np.exp(beta * (s - s.max()))
    rows = np.random.default_rng(seed).choice(len(test), size=len(test), p=p / p.sum())
    return test.take(rows)


def measure(name: str, fam: Pool, ref: np.ndarray, cal: Pool, bundle, reps: int,
            seed: int) -> list[dict]:
    """Per delta: the unweighted lambda* served without and with the gate, and the weighted one
    (fitted on the traffic half the gate passes) with the gate, on the held-out halves."""
    deltas = bundle.deltas()
    lam_u = [bundle.lam(d) for d in deltas]
    sol = np.flatnonzero(cal.solvable & cal.passes)  # the calibration traces the gate passes
    at = np.searchsorted(np.flatnonzero(cal.passes), sol)  # their places among the passing
    cal_loss_u = losses(stop_indices([cal.scores[i] for i in sol], np.array(lam_u)),
                        [cal.labels[i] for i in sol])  # [n_deltas, n_solvable]
    keys = ("err_0", "err_u", "err_w", "tok_0", "tok_u", "tok_w", "lam_w", "n_eff", "n_kept",
            "mean_w", "bound", "est_u", "real_u", "passed")
    per: dict[str, list] = {k: [] for k in keys}
    g = bundle.give_up
    d2s = bundle.give_up_deltas()
    mu_u = [bundle.mu(d) for d in d2s]
    passing = np.flatnonzero(cal.passes)
    gkeys = ("gerr_0", "gerr_u", "gerr_w", "gave_0", "gave_u", "gave_w", "mu_w")
    per |= {k: [] for k in gkeys}
    rng = np.random.default_rng(seed)
    for r in range(reps):
        order = rng.permutation(len(fam))
        traffic, held = order[:len(fam) // 2], order[len(fam) // 2:]
        if fam.passes[traffic].sum() >= CV_FOLDS:
            rs = draw(bundle, ref, cal.x, fam.x[traffic], seed=r).resample
            kept, w = rs.kept[at], rs.weights[at]
            kept_all = passing[rs.kept]  # every kept trace: the give-up risk is over all
            facts = (rs.n_eff, int(kept.sum()), float(rs.weights.mean()), rs.bound)
        else:  # the gate flags (nearly) all the traffic: nothing to reweight for
            kept, w = np.zeros(len(sol), dtype=bool), np.ones(len(sol))
            kept_all = np.array([], dtype=int)
            facts = (0.0, 0, 0.0, np.inf)
        if g is not None:
            mu_w = ([GIVE_UP_NEVER] * len(d2s) if not len(kept_all) else [x.mu for x in (
                calibrate_give_up([cal.give_up[i] for i in kept_all], cal.last[kept_all], d2s,
                                  epsilon=g.ltt.epsilon, grid=mu_grid(g.ltt.grid_size),
                                  pvalue=g.ltt.pvalue, policy=g.policy))])
            for key, mus, gated in (("0", mu_u, False), ("u", mu_u, True), ("w", mu_w, True)):
                out = [fam.give_up_outcome(held, m, g.policy, gated) for m in mus]
                per[f"gerr_{key}"].append([o[0] for o in out])
                per[f"gave_{key}"].append([o[1] for o in out])
            per["mu_w"].append(mu_w)
        res = weighted_calibrate([cal.scores[i] for i in sol], [cal.labels[i] for i in sol],
                                 kept, deltas, epsilon=bundle.ltt.epsilon,
                                 grid=default_grid(bundle.ltt.grid_size))
        out_0 = [fam.outcome(held, lam, gated=False) for lam in lam_u]
        out_u = [fam.outcome(held, lam) for lam in lam_u]
        out_w = [fam.outcome(held, x.lam) for x in res]
        for key, out in (("0", out_0), ("u", out_u), ("w", out_w)):
            per[f"err_{key}"].append([o[0] for o in out])
            per[f"tok_{key}"].append([o[3] for o in out])
        per["lam_w"].append([x.lam for x in res])
        per["est_u"].append((cal_loss_u * w).sum(axis=1) / w.sum())
        inside = held[fam.passes[held]]
        per["real_u"].append([fam.outcome(inside, lam)[0] if fam.solvable[inside].any()
                              else np.nan for lam in lam_u])  # nan: the gate passed none
        per["passed"].append(fam.passes[held].mean())
        for key, v in zip(("n_eff", "n_kept", "mean_w", "bound"), facts):
            per[key].append(v)
    a = {k: np.asarray(v, dtype=float) for k, v in per.items() if v}
    rows = []
    for j, d in enumerate(deltas):
        lw = a["lam_w"][:, j]
        row = {"family": name, "delta": d, "n_family": len(fam),
               "n_solvable": int(fam.solvable.sum()), "reps": reps, "lam_u": lam_u[j],
               "passed": a["passed"].mean(), "lam_w_median": float(np.median(np.where(
                   np.isinf(lw), 1.0, lw))), "never_w": float(np.isinf(lw).mean()),
               "est_u": float(np.nanmean(a["est_u"][:, j])),
               "real_u": float(np.nanmean(a["real_u"][:, j])) if np.isfinite(
                   a["real_u"][:, j]).any() else float("nan"),
               "n_eff": a["n_eff"].mean(), "n_kept": a["n_kept"].mean(),
               "mean_w": a["mean_w"].mean(), "bound_median": float(np.median(a["bound"])),
               "n_cal": len(cal), "n_cal_passed": int(cal.passes.sum())}
        for key in ("0", "u", "w"):
            e = a[f"err_{key}"][:, j]
            row |= {f"err_{key}": e.mean(), f"err_{key}_sd": e.std(),
                    f"over_{key}": (e > d).mean(), f"tok_{key}": a[f"tok_{key}"][:, j].mean()}
        rows.append(row)
    for j, d in enumerate(d2s):
        mw = a["mu_w"][:, j]
        row = {"family": name, "give_up_delta": d, "mu_u": mu_u[j], "reps": reps,
               "n_family": len(fam), "mu_w_median": float(np.median(np.where(
                   np.isinf(mw), 0.0, mw))), "never_w": float(np.isinf(mw).mean())}
        for key in ("0", "u", "w"):
            e = a[f"gerr_{key}"][:, j]
            row |= {f"gerr_{key}": e.mean(), f"gover_{key}": (e > d).mean(),
                    f"gave_{key}": a[f"gave_{key}"][:, j].mean()}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", required=True, help="the job directory (bundle.json, trajectories/)")
    ap.add_argument("--family", action="append", default=[], metavar="NAME=TRAJECTORIES")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--beta", type=float, default=0.75, help="the tilted family's strength")
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
    train = Pool(ts, ts.split("train"), bundle, steps)
    families[f"in-dist tilted (beta {a.beta:g})"] = tilted(
        test, train, bundle.lam(bundle.default_delta), a.beta, a.seed)
    test_ids = [i for i in ts.split("test") if gate_features(ts.embeddings(i), steps) is not None]
    position = np.array([answer_position(ts.problems[i]) for i in test_ids])
    families["in-dist, answer late"] = test.take(np.flatnonzero(position > np.median(position)))
    for spec in a.family:
        name, path = spec.split("=", 1)
        other = TrajectorySet.open(path)
        families[name] = Pool(other, list(range(len(other))), bundle, steps)
        families[f"in-dist+{name}"] = concat(test, families[name])
    rows = []
    for name, fam in families.items():
        rows += measure(name, fam, ref, cal, bundle, a.reps, a.seed)
    print(f"job {job}: n_ref {len(ref)}, n_cal {len(cal)} ({int(cal.solvable.sum())} solvable, "
          f"{int(cal.passes.sum())} passed by the gate), gate steps {steps}, epsilon "
          f"{bundle.ltt.epsilon}, {a.reps} traffic/held-out splits")
    print("| family | delta | gate passes | ungated lambda*: error (sd; share > delta) / tokens "
          "saved | gated lambda*: error / tokens | gated weighted lambda* (median; share never): "
          "error / tokens | n_eff / kept / mean weight | assumption: weighted estimate vs "
          "realized, unweighted lambda*, gate passed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in (r for r in rows if "delta" in r):
        arm = [f"{r[f'err_{k}']:.3f} ({r[f'err_{k}_sd']:.3f}; {r[f'over_{k}']:.2f}) / "
               f"{r[f'tok_{k}']:.3f}" for k in ("0", "u", "w")]
        print(f"| {r['family']} | {r['delta']:g} | {r['passed']:.2f} | {r['lam_u']:.3f}: "
              f"{arm[0]} | {arm[1]} | {r['lam_w_median']:.3f} ({r['never_w']:.2f}): {arm[2]} | "
              f"{r['n_eff']:.0f} / {r['n_kept']:.0f} / {r['mean_w']:.3f} | {r['est_u']:.3f} vs "
              f"{r['real_u']:.3f} |")
    give_up = [r for r in rows if "give_up_delta" in r]
    if give_up:
        print("\n| family | give-up delta | ungated mu*: give-up error (share > delta) / gave up "
              "| gated mu* | gated, weighted mu* (median; share never) |\n|---|---|---|---|---|")
    for r in give_up:
        arm = [f"{r[f'gerr_{k}']:.3f} ({r[f'gover_{k}']:.2f}) / {r[f'gave_{k}']:.3f}"
               for k in ("0", "u", "w")]
        print(f"| {r['family']} | {r['give_up_delta']:g} | {r['mu_u']:.3f}: {arm[0]} | "
              f"{arm[1]} | {r['mu_w_median']:.3f} ({r['never_w']:.2f}): {arm[2]} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
