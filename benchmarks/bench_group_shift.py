"""Group-conditional lambda* on the long reasoner's shifted family (docs/METHOD.md section 12),
from the traces recorded for the shift replay: what an operator's `orca.group` tag buys where
the in-distribution bundle fails.

The shifted family's recorded traces (`bench_samples.py collect --reasoner long --family
shifted`) are replayed through the server's code path (`bench_replay_shift.replay_family`: the
shipped probe with its online update). Over `--splits` random halves, lambda* per delta is
certified by LTT (`orca_method.ltt.calibrate`, the bundle's epsilon and label mode, as the job's
`calibrate.groups` does per group) on one half, and the other half is served with it as a known
group's requests are (no gate: `lambda_source: group`). Reported per delta: how often the held-out
stop error (the certified loss) is within delta, its mean, and the held-out tokens and accuracy
against full reasoning and the thinking budget replayed from the same traces.

`--served`: the bundle's own group tables instead (the shipped long bundle's `groups`, each
certified on its family's calibration-only traces, prompts no replay saw: docs/CALIBRATE.md,
"Groups collected apart"), on ALL of each family's recorded traces, served as requests tagged
with the family are (`lambda_source: group`: no gate, lambda*_g; the two-sided arm with mu*_g
at delta_2 0.05): per delta the stop error under the bundle's label mode (the certified loss)
and under supervised labels, the give-up error, accuracy and tokens, all with 95% intervals,
against full reasoning and the thinking budget from the same traces.

`--pooled DIR [DIR ...]`: the statistical check of a group's table where one recorded set is
all there is. The family's traces in DIR (the group's calibration-only sets) and its held-out
recording are pooled, and LTT is run on `--reps` random calibration parts of n_cal of them
(`orca_method.ltt.split_replay`: the bundle's grid, p-value, epsilon and label mode; n_cal the
group's own unless `--n-cal`), each lambda* read on the rest. Per delta: the held-out error's
mean and 95th percentile, the share of splits above delta, and where the shipped split (DIR
calibrates, the recording tests) stands among them. LTT bounds by epsilon the share of
calibration draws whose risk exceeds delta; one test part's realized error exceeds delta more
often (its binomial noise), so the shipped split's figure is read against that spread.

`--compare DIR`: are the group's calibration set (DIR) and the held-out recording exchangeable?
Both were recorded by the job's collector from one prompt generator at two seeds; per trace
the walk the prompt asks for (|start - x|), its steps and tokens, full reasoning's accuracy,
the first right step, the gate score and the probe's scores, and the stop loss at fixed
lambdas, compared by two-sample tests (Mann-Whitney, Fisher), and each set's mean walk against
the generator's own (POPULATION draws at another seed).

`--rerecorded DIR`: the held-out prompts recorded again (DIR, by the job's collector), paired
with the held-out recording per prompt: the same per-trace figures (Wilcoxon signed-rank,
McNemar), the share of traces whose first step's embedding is the same, to float precision. A
difference in production shows here; one in the prompts cannot.

Usage: python benchmarks/bench_group_shift.py [--splits 50]
       python benchmarks/bench_group_shift.py --served [--families shifted hard] [--skip N]
       python benchmarks/bench_group_shift.py --pooled runs/long/trajectories-groups/shifted-cal
       python benchmarks/bench_group_shift.py --compare runs/long/trajectories-groups/shifted
       python benchmarks/bench_group_shift.py --rerecorded runs/rerecord/long-shifted
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_replay_shift import (  # noqa: E402
    BUNDLE,
    Replayed,
    GIVE_UP_DELTA,
    OUT,
    acc,
    arm_figures,
    budget_lines,
    cell,
    references,
    replay_family,
    served_ends,
    versus,
)
from bench_shift import against_budget  # noqa: E402
from bench_samples import BUDGETS, budget_answer, run_dir  # noqa: E402
from orca_calibrate.collect import read_prompts  # noqa: E402

from orca_demo.long import tasks  # noqa: E402
from orca_method.bundle import Bundle, load_bundle  # noqa: E402
from orca_method.labels import equivalent  # noqa: E402
from orca_method.ltt import calibrate, default_grid, split_replay  # noqa: E402
from orca_method.risk import is_counted, losses, stop_indices  # noqa: E402
from orca_method.thresholds import NEVER  # noqa: E402
from orca_method.trajectories import TrajectorySet  # noqa: E402


def served(bundle: Bundle, family: str, skip: int = 0) -> dict[str, Any]:
    """The family's recorded traces served with the bundle's table for group `family`, as
    tagged requests are (module docstring, `--served`); `skip`: leave out the traces of the
    first `skip` prompts of the recording (a set extended later: its fresh part alone)."""
    if bundle.group(family) is None:
        raise SystemExit(f"the bundle has no table for group {family!r}: add it "
                         "(orca-calibrate groups) first")
    rep = replay_family(bundle, TrajectorySet.open(run_dir("long", 1, family) / "trajectories"))
    if skip:
        order = {r["id"]: i for i, r in
                 enumerate(read_prompts(run_dir("long", 1, family) / "prompts.jsonl"))}
        rep = rep.subset([i for i, p in enumerate(rep.prompt or []) if order[p] >= skip])
        if not len(rep):
            raise SystemExit(f"--skip {skip} leaves none of {family}'s {len(order)} recorded "
                             "prompts to serve")
    none = np.zeros(len(rep), dtype=bool)
    policy, excl = bundle.give_up.policy, bundle.ltt.excluded_never_correct
    out = {"n": len(rep), "group": bundle.groups[family].model_dump(), **references(bundle, rep),
           "orca": []}
    mu = bundle.mu(GIVE_UP_DELTA, family)
    for delta in bundle.deltas():
        lam = bundle.lam(delta, family)
        point: dict[str, Any] = {"delta": delta, "lambda": lam, "mu": mu}
        for name, m in (("one-sided", None), ("two-sided", mu)):
            # a known group: no gate
            end, ended = served_ends(rep.stop, rep.give_up, lam, m, none, gate_steps=1)
            fig = arm_figures(rep, end, ended, none, policy, excl)
            fig["versus_budget"] = against_budget(fig, out["budget"])
            point[name] = fig
        out["orca"].append(point)
    return out


def served_table(family: str, rep: dict[str, Any]) -> str:
    g = rep["group"]
    lines = [f"**{family}, served as the group `{family}`** (n = {rep['n']} held-out traces; "
             f"the group's table: n_cal {g['ltt']['n_cal']}, epsilon {g['ltt']['epsilon']:g}; "
             f"full reasoning {rep['full']['tokens']:.0f} tokens, accuracy {acc(rep['full'])})",
             "", r"| delta | lambda\*_g | stop error (certified loss) | stop error (supervised) | "
             "accuracy | tokens | vs budget at its tokens | two-sided: give-up error | "
             "two-sided: accuracy |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in rep["orca"]:
        one, two = p["one-sided"], p["two-sided"]
        lam = "never" if p["lambda"] >= NEVER else f"{p['lambda']:.3f}"
        lines.append(f"| {p['delta']:g} | {lam} | {cell(one['stop_error_certified'])} | "
                     f"{cell(one['stop_error'])} | {acc(one)} | {one['tokens']:.0f} | "
                     f"{versus(one['versus_budget'])} | {cell(two['give_up_error'])} | "
                     f"{acc(two)} |")
    return "\n".join([*lines, "", *budget_lines(rep)])


def pooled(bundle: Bundle, family: str, cal_dirs: list[Path], n_cals: list[int] | None,
           reps: int) -> dict[str, Any]:
    """`--pooled` (module docstring): split replays of the family's pooled traces, and the
    shipped split (the group's table on the held-out recording) among them."""
    table = bundle.group(family)
    if table is None:
        raise SystemExit(f"the bundle has no table for group {family!r}")
    excl = bundle.ltt.excluded_never_correct
    held = replay_family(bundle, TrajectorySet.open(run_dir("long", 1, family) / "trajectories"))
    parts = [replay_family(bundle, TrajectorySet.open(d)) for d in cal_dirs] + [held]
    stop, labels, is_test = [], [], []
    for k, rep in enumerate(parts):
        for s, c in zip(rep.stop, rep.certified):
            if is_counted(c, excl):
                stop.append(s)
                labels.append(c)
                is_test.append(k == len(parts) - 1)
    test = np.flatnonzero(is_test)
    grid = default_grid(table.ltt.grid_size)
    loss = losses(stop_indices(stop, grid), labels)  # [m, n]
    shipped = {}
    for delta in bundle.deltas():
        lam = bundle.lam(delta, family)
        tau = stop_indices([stop[i] for i in test], np.array([lam]))
        shipped[delta] = float(losses(tau, [labels[i] for i in test]).mean())
    out: dict[str, Any] = {"n": len(stop), "n_held_out": len(test), "reps": reps,
                           "group_n_cal": table.ltt.n_cal, "shipped": shipped, "splits": []}
    for n_cal in n_cals or [len(stop) - len(test)]:
        sr = split_replay(loss, n_cal, bundle.deltas(), table.ltt.epsilon, table.ltt.pvalue,
                          reps=reps, seed=0)
        rows = []
        for d, delta in enumerate(sr.deltas):
            row = sr.row(d)
            row["shipped_quantile"] = float(np.mean(sr.held_out[:, d] < shipped[delta]))
            rows.append(row)
        out["splits"].append({"n_cal": n_cal, "n_test": sr.n_test, "rows": rows})
    return out


def pooled_table(family: str, rep: dict[str, Any]) -> str:
    lines = [f"**{family}, pooled** ({rep['n']} counted traces: the group's calibration sets "
             f"and {rep['n_held_out']} held out; {rep['reps']} random splits each)", "",
             "| n_cal / n_test | delta | held-out error: mean (95th pct) | share of splits "
             "above delta | shipped split: error (its quantile) |",
             "| --- | --- | --- | --- | --- |"]
    for sp in rep["splits"]:
        for r in sp["rows"]:
            lines.append(f"| {sp['n_cal']} / {sp['n_test']} | {r['delta']:g} | "
                         f"{r['mean_error']:.3f} ({r['p95_error']:.3f}) | "
                         f"{r['share_above_delta']:.3f} | {rep['shipped'][r['delta']]:.3f} "
                         f"({r['shipped_quantile']:.2f}) |")
    return "\n".join(lines)


POPULATION = 100_000  # the generator's own walks, for each set's mean against it
COMPARE_LAMS = (0.6, 0.5, 0.47, 0.45)  # lambdas whose stop loss the two sets compare at
_START = re.compile(r"Start at x=(\d+)")


def trace_features(rep: Replayed, prompts: list[str],
                   answers: list[str]) -> dict[str, np.ndarray]:
    """Per trace what `--compare` tests (module docstring); [n] each, nan where undefined."""
    walk = np.array([abs(int(_START.search(p).group(1)) - int(y))
                     for p, y in zip(prompts, answers)])
    first = [int(np.argmax(c)) if c.any() else -1 for c in rep.certified]
    nan = float("nan")
    out = {"walk": walk.astype(float), "steps": np.array([len(s) for s in rep.stop], float),
           "tokens": np.array([tr.completion for tr in rep.traces], float),
           "accuracy": np.array([equivalent(tr.final, y) for tr, y in zip(rep.traces, rep.truth)]),
           "first right step": np.array([f if f >= 0 else nan for f in first], float),
           "gate score": rep.gate_score,
           "score at step 6": np.array([s[5] if len(s) > 5 else nan for s in rep.stop]),
           "highest score before right": np.array([s[:f].max() if f > 0 else nan
                                                   for s, f in zip(rep.stop, first)])}
    counted = [i for i, c in enumerate(rep.certified) if c.any()]
    for lam in COMPARE_LAMS:
        loss = np.full(len(rep), nan)
        tau = stop_indices([rep.stop[i] for i in counted], np.array([lam]))
        loss[counted] = losses(tau, [rep.certified[i] for i in counted])[0]
        out[f"stop loss at {lam:g}"] = loss
    return out


def recorded_features(bundle: Bundle, ts: TrajectorySet) -> dict[str, np.ndarray]:
    """`trace_features` of a recorded set, replayed as the server scores it."""
    prompts = [json.loads(p.prompt)[0]["content"] for p in ts.problems]
    return trace_features(replay_family(bundle, ts), prompts, [p.answer for p in ts.problems])


def rerecorded(bundle: Bundle, family: str, again_dir: Path) -> dict[str, Any]:
    """`--rerecorded` (module docstring)."""
    first = TrajectorySet.open(run_dir("long", 1, family) / "trajectories")
    again = TrajectorySet.open(again_dir)
    pos = {p.id: i for i, p in enumerate(again.problems)}
    pairs = [(i, pos[p.id]) for i, p in enumerate(first.problems) if p.id in pos]
    fa, fb = recorded_features(bundle, first), recorded_features(bundle, again)
    rows = []
    for key in fa:
        x = np.array([fa[key][i] for i, _ in pairs], float)
        y = np.array([fb[key][j] for _, j in pairs], float)
        keep = ~np.isnan(x) & ~np.isnan(y)
        x, y = x[keep], y[keep]
        if key == "accuracy" or key.startswith("stop loss"):
            b10, b01 = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
            p = stats.binomtest(b10, b10 + b01).pvalue if b10 + b01 else 1.0
            test = f"McNemar ({b10} / {b01} discordant)"
        else:
            p = stats.wilcoxon(x, y).pvalue if np.any(x != y) else 1.0
            test = "Wilcoxon"
        rows.append({"feature": key, "first": float(x.mean()), "again": float(y.mean()),
                     "n": int(len(x)), "test": test, "p": float(p)})
    step0 = [float(np.abs(np.asarray(first.embeddings(i))[0]
                          - np.asarray(again.embeddings(j))[0]).max()) for i, j in pairs]
    return {"pairs": len(pairs), "features": rows,
            "step0_same": float(np.mean(np.array(step0) < 1e-4))}


def rerecorded_table(family: str, rep: dict[str, Any]) -> str:
    lines = [f"**{family}: the held-out prompts recorded twice** ({rep['pairs']} pairs; first "
             f"step's embedding the same in {rep['step0_same']:.0%} of them)", "",
             "| per trace | held-out recording | recorded again | test | p |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['feature']} | {r['first']:.3f} | {r['again']:.3f} | {r['test']} | "
              f"{r['p']:.3f} |" for r in rep["features"]]
    return "\n".join(lines)


def compare(bundle: Bundle, family: str, cal_dir: Path) -> dict[str, Any]:
    """`--compare` (module docstring)."""
    sets = {"calibration": TrajectorySet.open(cal_dir),
            "held out": TrajectorySet.open(run_dir("long", 1, family) / "trajectories")}
    feats = {name: recorded_features(bundle, ts) for name, ts in sets.items()}
    rng = random.Random(f"{family}:population")
    pop = np.array([abs(p.start - p.x) for p in
                    (tasks.make_problem(rng, family) for _ in range(POPULATION))])
    out: dict[str, Any] = {"n": {k: len(ts) for k, ts in sets.items()},
                           "population_walk": {"mean": float(pop.mean()), "sd": float(pop.std())},
                           "walk_vs_population": {}, "features": []}
    for name, f in feats.items():
        w = f["walk"]
        out["walk_vs_population"][name] = {
            "mean": float(w.mean()),
            "z": float((w.mean() - pop.mean()) / (pop.std() / np.sqrt(len(w)))),
            "ks_p": float(stats.kstest(w, pop).pvalue)}
    for key in feats["calibration"]:
        a, b = (f[key][~np.isnan(f[key].astype(float))].astype(float) for f in feats.values())
        if key == "accuracy" or key.startswith("stop loss"):
            p = stats.fisher_exact([[a.sum(), len(a) - a.sum()],
                                    [b.sum(), len(b) - b.sum()]]).pvalue
            test = "Fisher"
        else:
            p, test = stats.mannwhitneyu(a, b).pvalue, "Mann-Whitney"
        out["features"].append({"feature": key, "calibration": float(a.mean()), "n_cal": len(a),
                                "held_out": float(b.mean()), "n_held_out": len(b),
                                "test": test, "p": float(p)})
    return out


def compare_table(family: str, rep: dict[str, Any]) -> str:
    pop = rep["population_walk"]
    lines = [f"**{family}: calibration set ({rep['n']['calibration']}) against held out "
             f"({rep['n']['held out']})**; the generator's walk: mean {pop['mean']:.1f}, "
             f"sd {pop['sd']:.1f}"]
    for name, w in rep["walk_vs_population"].items():
        lines.append(f"- {name}: mean walk {w['mean']:.1f}, z {w['z']:+.2f} against the "
                     f"generator's, KS p {w['ks_p']:.3f}")
    lines += ["", "| per trace | calibration | held out | test | p |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['feature']} | {r['calibration']:.3f} | {r['held_out']:.3f} | {r['test']} | "
              f"{r['p']:.3f} |" for r in rep["features"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="shifted")
    ap.add_argument("--splits", type=int, default=50)
    ap.add_argument("--served", action="store_true", help="serve every recorded trace of "
                    "--families with the bundle's own group tables")
    ap.add_argument("--families", nargs="+", default=["shifted", "hard"])
    ap.add_argument("--skip", type=int, default=0, metavar="N", help="--served: leave out the "
                    "traces of each recording's first N prompts (its prompts.jsonl order)")
    ap.add_argument("--bundle", type=Path, default=BUNDLE)
    ap.add_argument("--pooled", type=Path, nargs="+", metavar="DIR", help="split replays of "
                    "--family's traces in these sets and its held-out recording")
    ap.add_argument("--n-cal", type=int, nargs="+", help="--pooled: calibration part sizes "
                    "(default: the traces of the --pooled sets)")
    ap.add_argument("--reps", type=int, default=2000, help="--pooled: random splits")
    ap.add_argument("--compare", type=Path, metavar="DIR", help="two-sample tests of --family's "
                    "calibration set DIR against its held-out recording")
    ap.add_argument("--rerecorded", type=Path, metavar="DIR", help="--family's held-out "
                    "prompts recorded again, paired with the held-out recording")
    a = ap.parse_args()
    bundle = load_bundle(a.bundle)
    modes = {  # report mode -> (its report, its table)
        "rerecorded": (lambda: rerecorded(bundle, a.family, a.rerecorded), rerecorded_table),
        "compare": (lambda: compare(bundle, a.family, a.compare), compare_table),
        "pooled": (lambda: pooled(bundle, a.family, a.pooled, a.n_cal, a.reps), pooled_table)}
    for name, (run, table) in modes.items():
        if getattr(a, name):
            OUT.mkdir(parents=True, exist_ok=True)
            rep = run()
            (OUT / f"group-{a.family}-{name}.json").write_text(json.dumps(rep, indent=1))
            print(table(a.family, rep), flush=True)
            return
    if a.served:
        OUT.mkdir(parents=True, exist_ok=True)
        for family in a.families:
            rep = served(bundle, family, a.skip)
            (OUT / f"group-{family}{f'-from{a.skip}' if a.skip else ''}.json").write_text(json.dumps(rep, indent=1))
            print(served_table(family, rep), "\n", flush=True)
        return
    rep = replay_family(bundle, TrajectorySet.open(run_dir("long", 1, a.family) / "trajectories"))
    deltas = [r.delta for r in bundle.ltt.rows]
    excl, policy = bundle.ltt.excluded_never_correct, bundle.give_up.policy
    rng = np.random.default_rng(12)
    n = len(rep)
    rows: dict[float, list[dict]] = {d: [] for d in deltas}
    for _ in range(a.splits):
        perm = rng.permutation(n)
        cal, test = rep.subset(perm[: n // 2]), rep.subset(perm[n // 2:])
        keep = [i for i in range(len(cal)) if is_counted(cal.certified[i], excl)]
        results = calibrate([cal.stop[i] for i in keep], [cal.certified[i] for i in keep],
                            deltas, epsilon=bundle.ltt.epsilon)
        none = np.zeros(len(test), dtype=bool)
        for res in results:
            end, ended = served_ends(test.stop, test.give_up, res.lam, None, none, gate_steps=1)
            fig = arm_figures(test, end, ended, none, policy, excl)
            rows[res.delta].append({"lam": res.lam, "err": fig["stop_error_certified"]["rate"],
                                    "sup": fig["stop_error"]["rate"], "acc": fig["accuracy"],
                                    "tokens": fig["tokens"]})
    full_tokens = float(np.mean([tr.completion for tr in rep.traces]))
    full_acc = float(np.mean([equivalent(tr.final, y) for tr, y in zip(rep.traces, rep.truth)]))
    print(f"**long, {a.family}, group-conditional lambda\\*** (n = {n}: {n // 2} calibrate, "
          f"{n - n // 2} held out; {a.splits} random splits; epsilon {bundle.ltt.epsilon:g}; "
          f"full reasoning {full_tokens:.0f} tokens, accuracy {full_acc:.3f})\n")
    print("| delta | lambda\\* (median; never certified) | held-out stop error: mean, "
          "within delta | supervised stop error, mean | accuracy, mean | tokens, mean |")
    print("| --- | --- | --- | --- | --- | --- |")
    for d in deltas:
        r = rows[d]
        lams = [x["lam"] for x in r]
        finite = [x for x in lams if x < NEVER]
        med = f"{np.median(finite):.3f}" if finite else "-"
        print(f"| {d:g} | {med}; {len(lams) - len(finite)}/{len(lams)} | "
              f"{np.mean([x['err'] for x in r]):.3f}, "
              f"{np.mean([x['err'] <= d for x in r]):.2f} | "
              f"{np.mean([x['sup'] for x in r]):.3f} | {np.mean([x['acc'] for x in r]):.3f} | "
              f"{np.mean([x['tokens'] for x in r]):.0f} |")
    print("\n| thinking budget B (all traces) | accuracy | tokens |\n| --- | --- | --- |")
    for b in BUDGETS["long"]:
        res = [budget_answer(tr, b) for tr in rep.traces]
        ok = [equivalent(x, y) for (x, _), y in zip(res, rep.truth)]
        print(f"| {b} | {np.mean(ok):.3f} | {np.mean([t for _, t in res]):.0f} |")


if __name__ == "__main__":
    main()
