"""Issue 35's done-means as a frontier over delta_vote, out of sample (offline, from the traces
`bench_samples.py collect` recorded; no engine).

delta_vote is the user's knob, and the consensus certificate holds for each value fixed in
advance. For each delta_vote of `DELTAS_VOTE`, these arms (count weights unless said):

- the **margin rule alone** at a fixed launch (`FIXED_STOP`, `FIXED_WAVES`: per-sample delta 0.1,
  waves 2+2+2+2); the rule's design predates the data, the launch was picked on the first 100
  prompts (benchmarks/RESULTS.md, "One confident sample settles");
- the same launch **+ one confident sample** (the clause, docs/METHOD.md section 14), whose
  signal was also picked on the first 100 prompts;
- a launch **chosen out of fold**: for test fold f, fold f + 1 chooses among `CANDIDATES`
  (per-sample stop x wave schedule x rule) the one with the fewest tokens at the hypothesis LTT
  would certify were the certifying groups' errors at the choosing fold's rates
  (`bench_samples.selected_arm`'s plug-in guess), and the other folds, which chose nothing,
  certify it. Any choice keeps the certificate valid; a poor guess costs tokens, never error;
- three launches new here, each fixed before it was run (`NEW`, `WEIGHTED`): *rolling pairs*
  (two samples run, the next launched whenever one finishes, where a wave waits for both), a
  *stricter stop for the first pair* only (lambda 0.9, which carries delta 0.05's per-sample
  certificate, then delta 0.1's lambda*), each with the margin alone and with the clause; and
  the margin rule over *agreement weights* (`agreement_weights`: a sample's weight is how often
  a stop in its band of reasoning tokens gave maj@k's answer, fitted on a fold that certifies
  nothing).

Each arm is certified by K-fold cross-fitting over every recorded prompt (each fold's rule by LTT
on the other folds; an uncertified fold runs its samples to their end: maj@k itself), and the
fold assignment is redrawn with `--seeds` seeds, so a figure near a target is read against the
spread of splits rather than one lucky split. Per delta_vote and arm: accuracy against maj@k
(paired bootstrap interval by prompt, seed 0), tokens as a share of maj@k's and of single full
reasoning's, the realized vote error (exact interval, seed 0), each as mean and range over the
seeds, and in how many seeds (a) and (b) hold. Then the clean holdout: the fixed launches
certified on the first `--old` prompts alone, served on the later (fresh) ones. With
`--fresh-only` the frontier is drawn over the fresh prompts alone, none of which chose a rule,
a signal or a launch.

`--plot PATH` draws accuracy against tokens per prompt: maj@k, single, ESC, Adaptive-
Consistency, the thinking budget x k, and ORCA's vote at each delta_vote (seed means), each
point labelled with its realized vote error.

Usage:
  python benchmarks/bench_samples_frontier.py --reasoner long \
      --plot benchmarks/vote-frontier-long.png
  python benchmarks/bench_samples_frontier.py --reasoner long --fresh-only
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_samples import (  # noqa: E402
    ADAPTIVE_CONFIDENCE,
    BUDGETS,
    EPSILON,
    ESC_WINDOWS,
    adaptive_consistency,
    budget_answer,
    esc,
    sequential,
    wilson,
)
from bench_samples_holdout import (  # noqa: E402
    ONES,
    PAIRS,
    Recording,
    Served,
    accuracy_gap,
    baselines,
    SIGNAL_EDGES,
    certify,
    cross_fit,
    figures,
    load,
    rule_text,
    serve_fold,
    table,
)

from orca_calibrate.evaluate import interval95 as clopper_pearson  # noqa: E402
from orca_method.consensus import (  # noqa: E402
    Group,
    confident_path,
    default_grid,
    format_waves,
    launched,
    plurality,
)
from orca_method.ltt import binomial_pvalues, n_rejected  # noqa: E402

DELTAS_VOTE = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4)
FOLDS = 5
SEEDS = 20
OUT = ROOT / "runs" / "bench-samples" / "vote-frontier.json"


@dataclass(frozen=True)
class Candidate:
    """A launch of the consensus stop: per-sample stop (a key of `Recording.stopped`), wave
    schedule (None: all at once) or rolling launches (`rolling` w > 0: `rolling`), and whether
    one confident sample may settle."""

    stop: str
    waves: tuple[int, ...] | None
    confident: bool
    rolling: int = 0

    @property
    def name(self) -> str:
        launch = (f"rolling {self.rolling}" if self.rolling else "all at once"
                  if self.waves is None else f"waves {format_waves(self.waves)}")
        return f"{self.stop}, {launch}, " + ("+ one confident sample" if self.confident
                                             else "margin alone")

    def launch(self, groups: list[Group]) -> list[Group]:
        if not self.rolling:
            return launched(groups, self.waves)
        return [replace(g, start=start, finish=finish) for g in groups
                for start, finish in [rolling(g.finish, self.rolling)]]


def rolling(lengths: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray]:
    """(start [k], finish [k]) of samples launched rolling, in sample order: w run at once, and
    the next is launched as soon as a running one finishes (a wave waits for all of its own).
    `lengths` [k]: each sample's own tokens to its finish."""
    lengths = np.asarray(lengths, dtype=float)
    start = np.zeros_like(lengths)
    running = list(lengths[:w])  # finish times of the samples running
    heapq.heapify(running)
    for i in range(w, len(lengths)):
        start[i] = heapq.heappop(running)
        heapq.heappush(running, start[i] + lengths[i])
    return start, start + lengths


def stricter_first(strict: list[Group], rest: list[Group], m: int) -> list[Group]:
    """Groups whose first m samples stop by `strict`'s per-sample stop and the others by
    `rest`'s (the same samples; the reference is unchanged)."""
    def cut(a: Group, b: Group) -> Group:
        both = lambda x, y: np.concatenate([x[:m], y[m:]])  # noqa: E731
        return replace(b, finish=both(a.finish, b.finish), weights=both(a.weights, b.weights),
                       answers=a.answers[:m] + b.answers[m:],
                       stop_tokens=both(a.stop_tokens, b.stop_tokens))
    return [cut(a, b) for a, b in zip(strict, rest)]


FIXED_STOP, FIXED_WAVES = "delta 0.1", PAIRS
MARGIN, CLAUSE = Candidate(FIXED_STOP, FIXED_WAVES, False), Candidate(FIXED_STOP, FIXED_WAVES, True)
CHOSEN = "chosen out of fold"
WEIGHTED = f"{FIXED_STOP}, waves {format_waves(FIXED_WAVES)}, agreement weights fit out of fold"
CANDIDATES = tuple(Candidate(stop, waves, confident)
                   for stop in ("delta 0.05", "delta 0.1", "delta 0.15", "delta 0.2", "lambda 0.9")
                   for waves in (None, (2, 2, 4), PAIRS, (1, 1, 2, 4), ONES)
                   for confident in (False, True))
# launches not tried before this benchmark, each fixed before it was run: rolling pairs (a
# sample launched whenever one of two running finishes), and a stricter stop for the first pair
# only (lambda 0.9 carries delta 0.05's certificate, so every sample keeps delta 0.1's)
STRICT_FIRST = "lambda 0.9 first pair, then delta 0.1"
NEW = tuple(Candidate(stop, waves, confident, roll)
            for stop, waves, roll in ((FIXED_STOP, None, 2), (STRICT_FIRST, FIXED_WAVES, 0))
            for confident in (False, True))
FIXED = (MARGIN, CLAUSE) + NEW

Table = tuple[np.ndarray, np.ndarray, np.ndarray]  # [H, n] vote error, correct, tokens


def tables(rec: Recording, k: int) -> dict[Candidate, Table]:
    """Every candidate's outcome (and the new launches') at every hypothesis of its path on
    every group."""
    stopped = rec.stopped | {STRICT_FIRST: stricter_first(rec.stopped["lambda 0.9"],
                                                          rec.stopped[FIXED_STOP], 2)}
    out = {}
    for cand in CANDIDATES + NEW:
        t, c = confident_path(k) if cand.confident else (default_grid(), None)
        out[cand] = table(cand.launch(stopped[cand.stop]), rec.full, rec.truth, t, c, None)
    return out


def fresh_part(rec: Recording) -> Recording:
    """The recording's fresh prompts alone."""
    keep = np.flatnonzero(rec.fresh)
    return Recording(full=[rec.full[i] for i in keep], truth=[rec.truth[i] for i in keep],
                     fresh=rec.fresh[keep],
                     stopped={s: [g[i] for i in keep] for s, g in rec.stopped.items()})


def guess_cost(err: np.ndarray, tok: np.ndarray, full_tokens: np.ndarray, n_cert: int,
               delta_vote: float) -> float:
    """The choosing fold's tokens per prompt at the hypothesis LTT would certify on `n_cert`
    groups erring at this fold's rates (`err`, `tok` [H, n_pick]); maj@k's when none."""
    counts = np.round(err.mean(axis=1) * n_cert).astype(np.int64)  # [H]
    last = n_rejected(binomial_pvalues(counts, n_cert, delta_vote), EPSILON) - 1
    return float(full_tokens.mean() if last < 0 else tok[last].mean())


def chosen_fit(tabs: dict[Candidate, Table], full_tokens: np.ndarray, maj_ok: np.ndarray,
               folds: np.ndarray, delta_vote: float) -> tuple[Served, list[str]]:
    """For test fold f: fold f + 1 chooses the candidate (`guess_cost`), the other folds certify
    its rule, fold f is served by it. Returns the served outcome and the choice per fold."""
    n, F = len(folds), int(folds.max()) + 1
    out, picks = Served(np.zeros(n, bool), np.zeros(n, bool), np.zeros(n), []), []
    for f in range(F):
        pick, test = folds == (f + 1) % F, folds == f
        cert = ~pick & ~test
        n_cert = int(cert.sum())
        cand = min(CANDIDATES, key=lambda c: guess_cost(
            tabs[c][0][:, pick], tabs[c][2][:, pick], full_tokens[pick], n_cert, delta_vote))
        serve_fold(out, test, certify(tabs[cand][0][:, cert], delta_vote), tabs[cand],
                   full_tokens, maj_ok)
        picks.append(cand.name)
    return out, picks


def agreement_weights(fit: list[Group]) -> Callable[[np.ndarray], np.ndarray]:
    """Vote weights fitted on the groups `fit` (which must certify nothing): a sample's weight
    is how often, on those groups, a sample stopped by ORCA within the same band of reasoning
    tokens (`SIGNAL_EDGES`; one that ran to its end: a band of its own) gave maj@k's answer,
    (agree + 1) / (n + 2), in [0, 1] as the rule needs. The confidence clause's signal, made a
    weight: a short early stop counts nearly fully, a late one or a full trace little."""
    edges = np.asarray(SIGNAL_EDGES, dtype=float)

    def band(stop_tokens: np.ndarray) -> np.ndarray:
        st = np.asarray(stop_tokens, dtype=float)
        return np.where(np.isinf(st), len(edges) - 1, np.digitize(st, edges[1:-1]))

    b = np.concatenate([band(g.stop_tokens) for g in fit])
    agree = np.concatenate([[a == g.reference for a in g.answers] for g in fit])
    n_b = np.bincount(b, minlength=len(edges))
    w = (np.bincount(b, weights=agree, minlength=len(edges)) + 1) / (n_b + 2)
    return lambda stop_tokens: w[band(stop_tokens)]


def weighted_fit(groups: list[Group], rec: Recording, full_tokens: np.ndarray,
                 maj_ok: np.ndarray, folds: np.ndarray, delta_vote: float) -> Served:
    """The margin rule with `agreement_weights`: for test fold f, fold f + 1 fits the weights,
    the other folds certify t on the default grid, fold f is served."""
    n, F = len(folds), int(folds.max()) + 1
    out = Served(np.zeros(n, bool), np.zeros(n, bool), np.zeros(n), [])
    for f in range(F):
        pick, test = folds == (f + 1) % F, folds == f
        w_of = agreement_weights([g for g, p in zip(groups, pick) if p])
        weighted = [replace(g, weights=w_of(g.stop_tokens)) for g in groups]
        tab = table(weighted, rec.full, rec.truth, default_grid(), None, None)
        serve_fold(out, test, certify(tab[0][:, ~pick & ~test], delta_vote), tab, full_tokens,
                   maj_ok)
    return out


@dataclass
class Summary:
    """One arm at one delta_vote over the seeds: per seed accuracy - maj@k, tokens x maj@k and
    x single, vote errors; whether (a) and (b) held; seed 0's intervals."""

    gap: list[float]
    x_maj: list[float]
    x_single: list[float]
    errors: list[int]
    a: list[bool]
    b: list[bool]
    accuracy: list[float]
    tokens: list[float]
    first: dict

    def row(self, n: int) -> dict:
        def spread(x: list) -> dict:
            return {"mean": float(np.mean(x)), "min": float(np.min(x)), "max": float(np.max(x))}
        return {"gap": spread(self.gap), "x_maj": spread(self.x_maj),
                "x_single": spread(self.x_single), "vote_error": spread(np.array(self.errors) / n),
                "accuracy": spread(self.accuracy), "tokens": spread(self.tokens),
                "a_held": int(np.sum(self.a)), "b_held": int(np.sum(self.b)),
                "seeds": len(self.gap), "seed0": self.first}


def summarize(runs: list[Served], maj_ok: np.ndarray, maj_tokens: np.ndarray,
              single_ok: np.ndarray, single_tokens: np.ndarray, delta_vote: float,
              picks: list[list[str]] | None = None) -> Summary:
    """Issue 35's figures of one arm over its seeds' runs (every prompt served once per seed)."""
    s = Summary([], [], [], [], [], [], [], [], {})
    for r in runs:
        gap = float(r.ok.mean() - maj_ok.mean())
        x_maj = r.tokens.mean() / maj_tokens.mean()
        x_single = r.tokens.mean() / single_tokens.mean()
        e = int(r.err.sum())
        within = e / len(r.err) <= delta_vote
        s.gap.append(gap)
        s.x_maj.append(float(x_maj))
        s.x_single.append(float(x_single))
        s.errors.append(e)
        s.accuracy.append(float(r.ok.mean()))
        s.tokens.append(float(r.tokens.mean()))
        s.a.append(gap >= -0.02 and x_maj <= 0.4 and within)
        s.b.append(r.ok.mean() > single_ok.mean() and x_single <= 1.5 and within)
    r0, n = runs[0], len(runs[0].err)
    s.first = {"accuracy": float(r0.ok.mean()), "accuracy_ci": wilson(int(r0.ok.sum()), n),
               "gap": accuracy_gap(r0.ok, maj_ok), "vote_errors": s.errors[0],
               "vote_error_ci": clopper_pearson(s.errors[0], n), "rules": r0.rules,
               "picks": picks[0] if picks else None}
    return s


def other_arms(rec: Recording, reasoner: str, k: int) -> list[dict]:
    """The baselines on every prompt: accuracy, tokens per prompt and vote error (ESC,
    Adaptive-Consistency, the thinking budget x k; bench_samples.py's definitions)."""
    maj = rec.maj
    out = []

    def add(name: str, answers: list, tokens: list[float]) -> None:
        out.append({"arm": name, "accuracy": float(np.mean([a == y for a, y in
                                                            zip(answers, rec.truth)])),
                    "tokens": float(np.mean(tokens)),
                    "vote_error": float(np.mean([a != m for a, m in zip(answers, maj)]))})

    for level in ADAPTIVE_CONFIDENCE:
        res = [sequential(grp, adaptive_consistency(level)) for grp in rec.full]
        add(f"Adaptive-Consistency ({level})", [r[0] for r in res], [r[1] for r in res])
    for w in ESC_WINDOWS:
        res = [sequential(grp, esc(w)) for grp in rec.full]
        add(f"ESC (window {w})", [r[0] for r in res], [r[1] for r in res])
    for b in BUDGETS[reasoner]:
        res = [[budget_answer(tr, b) for tr in grp] for grp in rec.full]
        add(f"thinking budget {b} x {k}", [plurality([r[0] for r in rr]) for rr in res],
            [sum(r[1] for r in rr) for rr in res])
    return out


def fmt(x: dict, scale: float = 1.0, digits: int = 2, sign: bool = False) -> str:
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    return (f"{f.format(x['mean'] * scale)} [{f.format(x['min'] * scale)}, "
            f"{f.format(x['max'] * scale)}]")


def print_frontier(rows: list[dict], n: int) -> None:
    print("| delta_vote | arm | - maj@k: seed mean [range]; seed 0 (95% bootstrap) | x maj@k "
          "tokens [range] | x single [range] | != maj@k: seed mean [range]; seed 0 (95% CI) | "
          "(a) / (b) held in seeds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        s0 = r["seed0"]
        g, glo, ghi = s0["gap"]
        lo, hi = s0["vote_error_ci"]
        print(f"| {r['delta_vote']:g} | {r['arm']} | {fmt(r['gap'], 1, 3, True)}; {g:+.3f} "
              f"[{glo:+.3f}, {ghi:+.3f}] | {fmt(r['x_maj'])} | {fmt(r['x_single'])} | "
              f"{fmt(r['vote_error'], 1, 3)}; {s0['vote_errors']}/{n} [{lo:.3f}, {hi:.3f}] | "
              f"{r['a_held']} / {r['b_held']} of {r['seeds']} |")
    print()


def holdout(rec: Recording, tabs: dict[Candidate, Table], maj_ok: np.ndarray,
            maj_tokens: np.ndarray, single_ok: np.ndarray, single_tokens: np.ndarray) -> list[dict]:
    """The fixed launches (`FIXED`) certified on the old prompts alone, served on the fresh
    ones."""
    fresh = rec.fresh
    out = []
    print("**Certified on the old prompts, served on the fresh ones** (n = "
          f"{int(fresh.sum())}; fresh maj@k {maj_ok[fresh].mean():.3f} at "
          f"{maj_tokens[fresh].mean():,.0f} tokens, single {single_ok[fresh].mean():.3f} at "
          f"{single_tokens[fresh].mean():,.0f})\n")
    print("| delta_vote | arm (rule) | accuracy - maj@k (95% bootstrap) | x maj@k | x single | "
          "!= maj@k (95% CI) |\n| --- | --- | --- | --- | --- | --- |")
    for dv in DELTAS_VOTE:
        for cand in FIXED:
            err, ok, tok = tabs[cand]
            s = cross_fit(err, ok, tok, maj_tokens, maj_ok, fresh.astype(int), dv)
            h = s.rules[1]  # fold 1 (fresh) served by the rule certified on fold 0 (old)
            t, c = confident_path(len(rec.full[0])) if cand.confident else (default_grid(), None)
            rule = rule_text(t, c, None, h, len(rec.full[0]))
            f = figures(s, fresh, maj_ok, maj_tokens)
            g, (lo, hi), e, n = f["gap"], f["vote_error_ci"], f["vote_errors"], f["n"]
            x_single = f["tokens"] / single_tokens[fresh].mean()
            print(f"| {dv:g} | {cand.name} ({rule}) | {g[0]:+.3f} [{g[1]:+.3f}, {g[2]:+.3f}] | "
                  f"{f['x_maj']:.2f} | {x_single:.2f} | {e}/{n} = {e / n:.3f} "
                  f"[{lo:.3f}, {hi:.3f}] |")
            out.append({"delta_vote": dv, "arm": cand.name, "rule": rule, "gap": g,
                        "x_maj": f["x_maj"], "x_single": float(x_single), "vote_errors": e,
                        "n": n, "vote_error_ci": f["vote_error_ci"]})
    print()
    return out


def plot(path: Path, rows: list[dict], others: list[dict], maj: tuple[float, float],
         single: tuple[float, float], n: int) -> None:
    """Accuracy against tokens per prompt, whole (left) and near maj@k (right): the baselines
    as points, ORCA's vote as one line per arm over delta_vote (seed means; the rolling launches
    are left out, they lie on their waves' twins), each ORCA point that stops early labelled
    with delta_vote and its realized vote error (one that certifies nothing is maj@k itself)."""
    import matplotlib  # deferred: only the plot draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: only the plot draws

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [1, 1.4]})
    styles = {"ESC": ("s", "tab:purple"), "Adaptive": ("D", "tab:brown"),
              "thinking": ("v", "tab:gray")}
    arms = dict(zip([MARGIN.name, CLAUSE.name, NEW[3].name, CHOSEN],
                    ["tab:blue", "tab:orange", "tab:olive", "tab:green"]))
    for zoom, ax in enumerate(axes):
        ax.axvspan(0.5 * single[1], 0.4 * maj[1], color="tab:green", alpha=0.07,
                   label="(a): <= 40% of maj@8's tokens ...")
        ax.axhline(maj[0] - 0.02, color="tab:green", lw=0.8, ls=":",
                   label="... within 2 points of maj@8")
        ax.axvline(1.5 * single[1], color="tab:red", lw=0.8, ls=":",
                   label="(b): 1.5x single's tokens")
        ax.scatter(*maj[::-1], marker="*", s=160, color="black", label="maj@8", zorder=3)
        ax.scatter(*single[::-1], marker="o", s=60, color="black",
                   label="single full reasoning", zorder=3)
        for o in others:
            m, col = next(v for key, v in styles.items() if o["arm"].startswith(key))
            ax.scatter(o["tokens"], o["accuracy"], marker=m, color=col, s=30, zorder=3)
            ax.annotate(o["arm"].replace("thinking budget", "budget").replace(
                "Adaptive-Consistency", "AC"), (o["tokens"], o["accuracy"]), fontsize=6,
                xytext=(3, -8), textcoords="offset points", color=col)
        for a, (arm, col) in enumerate(arms.items()):
            pts = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["delta_vote"])
            x = [r["tokens"]["mean"] for r in pts]
            y = [r["accuracy"]["mean"] for r in pts]
            ax.plot(x, y, "-o", color=col, ms=3, lw=1, label=f"ORCA vote: {arm}")
            same: dict[tuple[float, float], list[dict]] = {}  # one label per distinct point
            for r, xi, yi in zip(pts, x, y):
                same.setdefault((round(xi), round(yi, 4)), []).append(r)
            for (xi, yi), rr in same.items():
                if zoom and xi < 0.95 * maj[1]:
                    dv = "/".join(f"{r['delta_vote']:g}" for r in rr)
                    ax.annotate(f"{dv}: {rr[0]['vote_error']['mean']:.2f}", (xi, yi),
                                fontsize=6, xytext=(2, 4 - 7 * a), textcoords="offset points",
                                color=col)
        ax.set_xscale("log")
        ax.set_xlabel("completion tokens per prompt (log)")
        ax.grid(alpha=0.3)
    axes[0].set_xlim(0.8 * single[1], 1.3 * maj[1])
    axes[0].set_ylabel("accuracy")
    axes[0].set_title(f"long reasoner, k = 8, n = {n}; {FOLDS}-fold cross-fitted, mean of seeds",
                      fontsize=8)
    axes[1].set_xlim(2400, 1.1 * maj[1])
    axes[1].set_ylim(maj[0] - 0.06, maj[0] + 0.012)
    axes[1].set_title("near maj@8; label: delta_vote: realized vote error (!= maj@8)",
                      fontsize=8)
    axes[1].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reasoner", default="long")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt")
    ap.add_argument("--old", type=int, default=100,
                    help="prompts numbered below this are the first recording's")
    ap.add_argument("--seeds", type=int, default=SEEDS, help="fold assignments (seeds 0..S-1)")
    ap.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    ap.add_argument("--fresh-only", action="store_true",
                    help="the frontier over the fresh prompts alone (none of them chose a rule, "
                    "a signal or a launch); no holdout")
    a = ap.parse_args()
    rec = load(a.reasoner, a.k, a.old)
    if a.fresh_only:
        rec = fresh_part(rec)
    maj_ok, maj_tokens, single_ok, single_tokens = baselines(rec)
    tabs = tables(rec, a.k)
    weighted_groups = MARGIN.launch(rec.stopped[FIXED_STOP])
    n = len(rec.full)
    print(f"**{a.reasoner}, k = {a.k}, n = {n} prompts** (epsilon {EPSILON}, {FOLDS}-fold "
          f"cross-fitting, {a.seeds} fold seeds; maj@k {maj_ok.mean():.3f} at "
          f"{maj_tokens.mean():,.0f} tokens, single {single_ok.mean():.3f} at "
          f"{single_tokens.mean():,.0f})\n")
    rows = []
    for dv in DELTAS_VOTE:
        runs: dict[str, list[Served]] = {c.name: [] for c in FIXED} | {CHOSEN: [],
                                                                        WEIGHTED: []}
        picks: list[list[str]] = []
        for seed in range(a.seeds):
            folds = np.random.default_rng(seed).permutation(n) % FOLDS
            for cand in FIXED:
                runs[cand.name].append(cross_fit(*tabs[cand], maj_tokens, maj_ok, folds, dv))
            served, chosen = chosen_fit(tabs, maj_tokens, maj_ok, folds, dv)
            runs[CHOSEN].append(served)
            picks.append(chosen)
            runs[WEIGHTED].append(weighted_fit(weighted_groups, rec, maj_tokens, maj_ok, folds,
                                               dv))
        for arm, rr in runs.items():
            s = summarize(rr, maj_ok, maj_tokens, single_ok, single_tokens, dv,
                          picks if arm == CHOSEN else None)
            rows.append({"delta_vote": dv, "arm": arm, **s.row(n)})
    print_frontier(rows, n)
    for r in rows:
        if r["arm"] == CHOSEN:
            print(f"- delta_vote {r['delta_vote']:g}, chosen per fold (seed 0): "
                  + "; ".join(r["seed0"]["picks"]))
    print()
    held = [] if a.fresh_only else holdout(rec, tabs, maj_ok, maj_tokens, single_ok,
                                           single_tokens)
    others = other_arms(rec, a.reasoner, a.k)
    for o in others:
        print(f"- {o['arm']}: accuracy {o['accuracy']:.3f}, {o['tokens']:,.0f} tokens "
              f"({o['tokens'] / maj_tokens.mean():.2f} x maj@k), != maj@k {o['vote_error']:.3f}")
    out = OUT.with_stem(OUT.stem + "-fresh") if a.fresh_only else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"n": n, "epsilon": EPSILON, "folds": FOLDS, "seeds": a.seeds,
                               "rows": rows, "holdout": held, "others": others}, indent=1,
                              default=float))
    if a.plot:
        plot(a.plot, rows, others, (float(maj_ok.mean()), float(maj_tokens.mean())),
             (float(single_ok.mean()), float(single_tokens.mean())), n)


if __name__ == "__main__":
    main()
