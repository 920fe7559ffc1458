"""Issue 35 on prompts the consensus rule never saw, and a cap on a group's cost certified inside
LTT (offline, from the traces `bench_samples.py collect` recorded; no engine).

The recording `runs/bench-samples/long-k8` holds the first recording's prompts (seed-35 stream,
ids ``<prefix>-<n>`` with n < ``--old``: the rule's signal and its launch were chosen looking at
them) and the prompts that extended it (n >= ``--old``: fresh). Two parts:

``check``: every launch reported on the old prompts (``LAUNCHES``: per-sample stop, count
weights, wave schedule, delta_vote, the confidence clause or not), its (t, c) certified by LTT
along the shipped path (`orca_method.consensus.confident_path`) on the old prompts only and
served on the fresh ones alone; the reverse (certified on fresh, served on old); and 5-fold
cross-fitting over all of them. Per test set: accuracy against that set's maj@k (the
difference with a paired bootstrap interval by prompt), tokens as a share of its maj@k, and the
vote error with its exact interval.

``cap``: the same rule with a third parameter, m, the most samples that may finish: a group is
also settled once m of its samples have finished, and answers the vote of those (ties to the
lowest sample). The loss is unchanged (the answer != maj@k of the k samples run to their end),
so LTT's bound covers the cap: the hypotheses (t, c, m) are one fixed sequence along a path of
`CapGrid`. The path is either *caps last*, fixed a priori (the shipped path's margin and caps,
then m from k - 1 down to 1 at the largest cap), or a *staircase* chosen on the old prompts
(which certify nothing on the fresh ones). Per delta_vote and launch: the rule certified by
5-fold cross-fitting on the old, the fresh and the pooled prompts; the launch picked on the old
prompts and read on the fresh ones; whether issue 35's (b) holds (accuracy above single full
reasoning's at <= 1.5x its tokens, vote error <= delta_vote); and, in sample, what (b) would
need whatever the path (the least vote error of any hypothesis within (b)'s budget).

Usage:
  python benchmarks/bench_samples_holdout.py check --reasoner long
  python benchmarks/bench_samples_holdout.py cap --reasoner long
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_samples import (  # noqa: E402
    EPSILON,
    FOLD_SEED,
    REASONERS,
    Trace,
    prompt_number,
    run_dir,
    traces,
    wilson,
)

from orca_calibrate.consensus import replayed, sample_groups, stopped_groups  # noqa: E402
from orca_calibrate.evaluate import interval95 as clopper_pearson  # noqa: E402
from orca_method.bundle import load_bundle  # noqa: E402
from orca_method.consensus import (  # noqa: E402
    NO_CAP,
    Group,
    confident_path,
    default_grid,
    first_t,
    format_waves,
    launched,
    plurality,
    settle_events,
    vote_path,
)
from orca_method.ltt import binomial_pvalues, n_rejected  # noqa: E402
from orca_method.outcomes import Weighting  # noqa: E402
from orca_method.trajectories import TrajectorySet  # noqa: E402

BOOT = 2000  # paired bootstrap resamples of the prompts (accuracy differences)
FOLDS = 5


@dataclass(frozen=True)
class Launch:
    """One procedure of the consensus stop, fixed in advance: the per-sample stop (a delta of
    the bundle, or a stricter lambda carrying its smallest delta's certificate), the wave
    schedule (None: all at once), delta_vote, and whether one confident sample may settle."""

    stop: str  # "delta 0.1" or "lambda 0.9"
    waves: tuple[int, ...] | None
    delta_vote: float
    confident: bool

    @property
    def name(self) -> str:
        launch = "all at once" if self.waves is None else f"waves {format_waves(self.waves)}"
        rule = " + one confident sample" if self.confident else ", margin alone"
        return f"{self.stop}, {launch}, delta_vote {self.delta_vote:g}{rule}"


ONES, PAIRS = (1,) * 8, (2, 2, 2, 2)
# the launches reported on the old prompts (benchmarks/RESULTS.md, "One confident sample
# settles"), the headline first
LAUNCHES = (
    Launch("delta 0.1", PAIRS, 0.15, True),
    Launch("delta 0.1", PAIRS, 0.15, False),
    Launch("delta 0.1", (2, 2, 4), 0.15, True),
    Launch("delta 0.1", ONES, 0.15, True),
    Launch("delta 0.1", ONES, 0.15, False),
    Launch("delta 0.05", ONES, 0.1, True),
    Launch("delta 0.05", ONES, 0.1, False),
    Launch("lambda 0.9", ONES, 0.1, True),
    Launch("lambda 0.9", PAIRS, 0.05, True),
    Launch("lambda 0.9", ONES, 0.05, False),
)
# the cap's candidates: per-sample stop x schedule (count weights, the confidence clause on)
CAP_STOPS = ("delta 0.05", "delta 0.1", "delta 0.2")
CAP_WAVES = (PAIRS, (1, 1, 2, 4), ONES)
CAP_DELTAS_VOTE = (0.1, 0.15, 0.2, 0.25)
CAPS_LAST, STAIRCASE = "caps last (fixed in advance)", "staircase chosen on the old prompts"


# ------------------------------------------------------------------------------ the data


@dataclass(frozen=True)
class Recording:
    """The recorded groups, each prompt's k samples: the full traces, truth, maj@k, and whether
    the prompt is fresh (after the first recording's); `stopped` per per-sample stop."""

    full: list[list[Trace]]
    truth: list[str]
    fresh: np.ndarray  # [n] bool
    stopped: dict[str, list[Group]]

    @property
    def maj(self) -> list[Hashable]:
        return [plurality([tr.final for tr in grp]) for grp in self.full]


def load(reasoner: str, k: int, old: int) -> Recording:
    ts = TrajectorySet.open(run_dir(reasoner, k) / "trajectories")
    groups = [g for g in sample_groups(ts, list(range(len(ts)))) if len(g) == k]
    number = [prompt_number(ts, g) for g in groups]
    bundle = load_bundle(ROOT / REASONERS[reasoner][1])
    scores = replayed(bundle.load_probe(), ts, groups, bundle.window)
    lams = {f"delta {r.delta:g}": bundle.lam(r.delta) for r in bundle.ltt.rows}
    lams |= {"lambda 0.9": 0.9}
    return Recording(full=traces(ts, groups), truth=[ts.problems[g[0]].answer for g in groups],
                     fresh=np.array(number) >= old,
                     stopped={s: stopped_groups(ts, groups, scores, lam, Weighting.COUNT)
                              for s, lam in lams.items()})


# ----------------------------------------------------------------------- the rule's table


@dataclass(frozen=True)
class CapGrid:
    """Every hypothesis (t, c, m) a path of the capped rule may visit, fixed in advance: the
    shipped path's margin part (t from 1 down to `first_t`, no clause, m = k), then at `first_t`
    each cap c (off, 25, 50, ... DEFAULT_CAP_MAX) with each m from k down to 1 (m = k: no cap on
    the samples). `at(ci, m)` is the index of (caps[ci], m)."""

    t: np.ndarray  # [H]
    c: np.ndarray  # [H]
    most: np.ndarray  # [H]
    margin: int  # the margin part's length: hypotheses 0 .. margin - 1
    caps: np.ndarray  # [C] NO_CAP first
    k: int

    @classmethod
    def of(cls, k: int) -> CapGrid:
        t, c = confident_path(k)
        head = int((t >= first_t(k)).sum() - (c[t >= first_t(k)] != NO_CAP).sum())
        caps = np.concatenate([[NO_CAP], c[c != NO_CAP][t[c != NO_CAP] == first_t(k)]])
        cc, mm = np.meshgrid(caps, np.arange(k, 0, -1, dtype=float), indexing="ij")  # [C, k]
        return cls(t=np.concatenate([t[:head], np.full(cc.size, first_t(k))]),
                   c=np.concatenate([np.full(head, NO_CAP), cc.ravel()]),
                   most=np.concatenate([np.full(head, float(k)), mm.ravel()]),
                   margin=head, caps=caps, k=k)

    def at(self, ci: int, m: int) -> int:
        return self.margin + ci * self.k + (self.k - m)

    def caps_last(self) -> np.ndarray:
        """The path fixed before any data: the shipped path's margin and caps (m = k), then, at
        the largest cap, m from k - 1 down to 1. The blunt cap comes last: it answers whatever
        the finished samples say, so it costs vote error exactly where the samples disagree."""
        last = len(self.caps) - 1
        caps = [self.at(ci, self.k) for ci in range(1, last + 1)]
        return np.array(list(range(self.margin)) + caps
                        + [self.at(last, m) for m in range(self.k - 1, 0, -1)])

    def staircase(self, err: np.ndarray, tok: np.ndarray, every: int = 10) -> np.ndarray:
        """A path chosen on data (`err`, `tok` [H, n] of the choosing prompts, which must not be
        the ones that certify it): the margin part, then from (no clause, m = k) one step at a
        time, raising c by `every` grid steps or lowering m by one, whichever keeps the choosing
        prompts' vote error lower (ties: fewer tokens), to (the largest cap, m = 1)."""
        risk, cost = err.mean(axis=1), tok.mean(axis=1)
        ci, m, last = 0, self.k, len(self.caps) - 1
        out = list(range(self.margin)) + [self.at(ci, m)]
        while (ci, m) != (last, 1):
            moves = ([(min(ci + every, last), m)] if ci < last else []) + (
                [(ci, m - 1)] if m > 1 else [])
            ci, m = min(moves, key=lambda x: (risk[self.at(*x)], cost[self.at(*x)]))
            out.append(self.at(ci, m))
        return np.array(out)


def table(groups: Sequence[Group], full: Sequence[Sequence[Trace]], truth: Sequence[str],
          t: np.ndarray, c: np.ndarray | None, most: np.ndarray | None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[H, n] vote error (answer != maj@k of the full samples), correctness and tokens (the
    samples' until the group settles plus the answers of those finished) of every hypothesis
    (t, c, m) on every group; c None: no confidence clause; m None: no sample cap."""
    H, n = len(t), len(groups)
    err, ok, tok = np.zeros((H, n), bool), np.zeros((H, n), bool), np.zeros((H, n))
    for j, (g, grp, y) in enumerate(zip(groups, full, truth)):
        path = vote_path(g)
        e = settle_events(path, t, c)  # [H]
        if most is not None:
            done = len(g.answers) - path.running  # [E] samples finished at each event
            e = np.minimum(e, (done[None, :] >= most[:, None]).argmax(axis=1))
        answer_tokens = np.array([sum(tr.answer_tokens for tr, f in zip(grp, g.finish) if f <= s)
                                  for s in path.times])  # [E]
        cost = np.array([g.spent(s) for s in path.times]) + answer_tokens  # [E]
        leaders = np.array([a != g.reference for a in path.leaders])
        right = np.array([a == y for a in path.leaders])
        err[:, j], ok[:, j], tok[:, j] = leaders[e], right[e], cost[e]
    return err, ok, tok


def certify(err: np.ndarray, delta_vote: float) -> int:
    """The last hypothesis LTT's fixed sequence rejects on these groups' errors [H, n] (binomial
    p-values, EPSILON), -1 when none: the group then runs every sample to its end (maj@k)."""
    n = err.shape[1]
    return n_rejected(binomial_pvalues(err.sum(axis=1, dtype=np.int64), n, delta_vote),
                      EPSILON) - 1


@dataclass
class Served:
    """One rule's per-prompt outcome on a test set, each prompt judged by a rule certified
    without it."""

    err: np.ndarray
    ok: np.ndarray
    tokens: np.ndarray
    rules: list[int]  # the certified hypothesis per fold (-1: none)


def cross_fit(err: np.ndarray, ok: np.ndarray, tok: np.ndarray, full_tokens: np.ndarray,
              maj_ok: np.ndarray, folds: np.ndarray, delta_vote: float) -> Served:
    """Each fold served by the hypothesis certified on the other folds (prompts in fold -1 take no
    part); an uncertified fold runs every sample to its end, answering maj@k at its tokens."""
    n = err.shape[1]
    out = Served(np.zeros(n, bool), np.zeros(n, bool), np.zeros(n), [])
    for f in np.unique(folds[folds >= 0]):
        test, cal = folds == f, (folds != f) & (folds >= 0)
        serve_fold(out, test, certify(err[:, cal], delta_vote), (err, ok, tok), full_tokens,
                   maj_ok)
    return out


def serve_fold(out: Served, test: np.ndarray, h: int,
               tab: tuple[np.ndarray, np.ndarray, np.ndarray], full_tokens: np.ndarray,
               maj_ok: np.ndarray) -> None:
    """Serve the prompts of `test` by hypothesis h of `tab` ([H, n] error, correct, tokens);
    h < 0 (nothing certified): every sample runs to its end, answering maj@k at its tokens."""
    err, ok, tok = tab
    out.rules.append(h)
    if h < 0:
        out.ok[test], out.tokens[test] = maj_ok[test], full_tokens[test]
    else:
        out.err[test], out.ok[test], out.tokens[test] = err[h, test], ok[h, test], tok[h, test]


# -------------------------------------------------------------------------------- figures


def accuracy_gap(ok: np.ndarray, ref: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """(mean of ok - ref, 95% paired bootstrap interval by prompt)."""
    d = ok.astype(float) - ref.astype(float)
    rng = np.random.default_rng(seed)
    boot = d[rng.integers(0, len(d), (BOOT, len(d)))].mean(axis=1)
    return float(d.mean()), float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))


def figures(s: Served, mask: np.ndarray, maj_ok: np.ndarray, maj_tokens: np.ndarray) -> dict:
    n, e = int(mask.sum()), int(s.err[mask].sum())
    gap = accuracy_gap(s.ok[mask], maj_ok[mask])
    return {"n": n, "accuracy": float(s.ok[mask].mean()),
            "accuracy_ci": wilson(int(s.ok[mask].sum()), n),
            "maj_accuracy": float(maj_ok[mask].mean()), "gap": gap,
            "tokens": float(s.tokens[mask].mean()),
            "x_maj": float(s.tokens[mask].mean() / maj_tokens[mask].mean()),
            "vote_errors": e, "vote_error": e / n, "vote_error_ci": clopper_pearson(e, n)}


def line(label: str, f: dict, single_tokens: float) -> str:
    lo, hi = f["vote_error_ci"]
    g, glo, ghi = f["gap"]
    return (f"| {label} | {f['accuracy']:.3f} [{f['accuracy_ci'][0]:.3f}, "
            f"{f['accuracy_ci'][1]:.3f}] | {f['maj_accuracy']:.3f} | {g:+.3f} [{glo:+.3f}, "
            f"{ghi:+.3f}] | {f['tokens']:,.0f} | {f['x_maj']:.2f} | "
            f"{f['tokens'] / single_tokens:.2f} | {f['vote_errors']}/{f['n']} = "
            f"{f['vote_error']:.3f} [{lo:.3f}, {hi:.3f}] |")


def head(first: str, extra: str = "") -> str:
    cols = [first, "accuracy (95% CI)", "maj@k", "- maj@k (95% bootstrap)", "tokens / prompt",
            "x maj@k", "x single", "!= maj@k (95% CI)"] + ([extra] if extra else [])
    return "| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols)


def baselines(rec: Recording) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per prompt: maj@k correct, maj@k tokens, single full reasoning's accuracy and tokens
    (the mean over the k samples)."""
    maj_ok = np.array([m == y for m, y in zip(rec.maj, rec.truth)])
    maj_tokens = np.array([float(sum(tr.completion for tr in grp)) for grp in rec.full])
    single_ok = np.array([np.mean([tr.final == y for tr in grp])
                          for grp, y in zip(rec.full, rec.truth)])
    single_tokens = np.array([np.mean([tr.completion for tr in grp]) for grp in rec.full])
    return maj_ok, maj_tokens, single_ok, single_tokens


def print_baselines(rec: Recording) -> float:
    maj_ok, maj_tokens, single_ok, single_tokens = baselines(rec)
    print("| prompts | n | single (mean of k) | single tokens | maj@k (95% CI) | maj@k tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, m in parts(rec):
        n = int(m.sum())
        lo, hi = wilson(int(maj_ok[m].sum()), n)
        print(f"| {label} | {n} | {single_ok[m].mean():.3f} | {single_tokens[m].mean():,.0f} | "
              f"{maj_ok[m].mean():.3f} [{lo:.3f}, {hi:.3f}] | {maj_tokens[m].mean():,.0f} |")
    print()
    return float(single_tokens.mean())


def parts(rec: Recording) -> list[tuple[str, np.ndarray]]:
    return [("old", ~rec.fresh), ("fresh", rec.fresh), ("all", np.ones_like(rec.fresh))]


def folds_of(mask: np.ndarray) -> np.ndarray:
    """FOLDS seeded folds over the prompts of `mask` (-1 elsewhere), as bench_samples' report
    draws them (the old prompts alone get the old report's folds)."""
    out = np.full(len(mask), -1)
    out[mask] = np.random.default_rng(FOLD_SEED).permutation(int(mask.sum())) % FOLDS
    return out


def rule_text(t: np.ndarray, c: np.ndarray | None, most: np.ndarray | None, h: int,
              k: int) -> str:
    """Hypothesis h of the path, as text ("none": no hypothesis certified)."""
    if h < 0:
        return "none"
    cap = "" if c is None or c[h] == NO_CAP else f", c {c[h]:.0f}"
    m = "" if most is None or most[h] >= k else f", m {most[h]:.0f}"
    return f"t {t[h]:.2f}{cap}{m}"


# ---------------------------------------------------------------------------------- check


SIGNAL_EDGES = (0, 500, 1000, 1500, 2000, 2500, np.inf)  # reasoning tokens at an early stop


def print_signal(rec: Recording) -> None:
    """The confidence clause's signal on each set: how often a sample's stopped answer agrees
    with maj@k, by the reasoning tokens where ORCA stopped it (samples that ran to their end
    last). Chosen on the old prompts; the fresh ones say whether it carries over. The k samples
    of a prompt are not independent, so n overstates the evidence."""
    print("| per-sample stop | prompts | " + " | ".join(
        f"{lo:,.0f}-{hi:,.0f}" if hi < np.inf else f">= {lo:,.0f}"
        for lo, hi in zip(SIGNAL_EDGES[:-1], SIGNAL_EDGES[1:])) + " | ran to its end |")
    print("|" + " --- |" * (len(SIGNAL_EDGES) + 2))
    for stop, groups in rec.stopped.items():
        for label, mask in parts(rec)[:2]:
            st = np.array([x for g, m in zip(groups, mask) if m for x in g.stop_tokens])
            ag = np.array([a == g.reference for g, m in zip(groups, mask) if m
                           for a in g.answers])
            bins = [(st >= lo) & (st < hi) for lo, hi in zip(SIGNAL_EDGES[:-1], SIGNAL_EDGES[1:])]
            cells = [f"{ag[b].mean():.3f} ({b.sum()})" if b.any() else "-"
                     for b in bins + [np.isinf(st)]]
            print(f"| {stop} | {label} | " + " | ".join(cells) + " |")
    print()


def print_stops(rec: Recording) -> None:
    """Per set and per-sample stop: how often a stopped sample's answer differs from its own end
    (the per-sample loss; samples of a prompt are not independent), and how often the vote of
    all k stopped samples differs from maj@k (the floor of every consensus rule's vote error:
    its t = 1)."""
    print("| per-sample stop | prompts | stop error (samples) | full vote of the stopped "
          "samples != maj@k (95% CI) |\n| --- | --- | --- | --- |")
    for stop, groups in rec.stopped.items():
        for label, mask in parts(rec)[:2]:
            own = [a != tr.final for g, grp, m in zip(groups, rec.full, mask) if m
                   for a, tr in zip(g.answers, grp)]
            vote = sum(plurality(list(g.answers)) != g.reference
                       for g, m in zip(groups, mask) if m)
            n = int(mask.sum())
            lo, hi = clopper_pearson(vote, n)
            print(f"| {stop} | {label} | {np.mean(own):.3f} ({len(own)}) | {vote}/{n} = "
                  f"{vote / n:.3f} [{lo:.3f}, {hi:.3f}] |")
    print()


def cmd_check(a: argparse.Namespace) -> None:
    rec = load(a.reasoner, a.k, a.old)
    maj_ok, maj_tokens, _, _ = baselines(rec)
    one = print_baselines(rec)
    print_stops(rec)
    print_signal(rec)
    old, fresh = ~rec.fresh, rec.fresh
    report = []
    print(head("launch, certified on -> served on"))
    for launch in LAUNCHES:
        groups = launched(rec.stopped[launch.stop], launch.waves)
        t, c = confident_path(a.k) if launch.confident else (default_grid(), None)
        err, ok, tok = table(groups, rec.full, rec.truth, t, c, None)
        print(f"| **{launch.name}** | | | | | | | |")
        # two folds, old and fresh: each served by the rule certified on the other alone
        halves = cross_fit(err, ok, tok, maj_tokens, maj_ok, fresh.astype(int),
                           launch.delta_vote)
        runs = [("old -> fresh", halves, fresh, halves.rules[1:]),
                ("fresh -> old", halves, old, halves.rules[:1])]
        for label, mask in (("old", old), ("fresh", fresh), ("all", old | fresh)):
            s = cross_fit(err, ok, tok, maj_tokens, maj_ok, folds_of(mask), launch.delta_vote)
            runs.append((f"5-fold, {label}", s, mask, s.rules))
        for label, s, mask, rules in runs:
            f = figures(s, mask, maj_ok, maj_tokens)
            text = [rule_text(t, c, None, h, a.k) for h in rules]
            print(line(f"{label} ({'; '.join(text)})", f, one))
            report.append({"launch": launch.name, "run": label, "rules": text, **f})
    print()
    (run_dir(a.reasoner, a.k) / "holdout-check.json").write_text(json.dumps(report, indent=1))


# ------------------------------------------------------------------------------------ cap


def cmd_cap(a: argparse.Namespace) -> None:
    rec = load(a.reasoner, a.k, a.old)
    maj_ok, maj_tokens, single_ok, single_tokens = baselines(rec)
    one = print_baselines(rec)
    grid, old = CapGrid.of(a.k), ~rec.fresh
    tables, paths = {}, {}
    for stop in CAP_STOPS:
        for waves in CAP_WAVES:
            name = f"{stop}, {'all at once' if waves is None else 'waves ' + format_waves(waves)}"
            tables[name] = table(launched(rec.stopped[stop], waves), rec.full, rec.truth,
                                 grid.t, grid.c, grid.most)  # 3 x [H, n]
            paths[(name, CAPS_LAST)] = grid.caps_last()
            paths[(name, STAIRCASE)] = grid.staircase(tables[name][0][:, old],
                                                      tables[name][2][:, old])
    report: dict = {"rows": []}
    for dv in a.deltas_vote:
        for path in (CAPS_LAST, STAIRCASE):
            served = {}
            for name, (err, ok, tok) in tables.items():
                idx = paths[(name, path)]
                for label, mask in parts(rec):
                    s = cross_fit(err[idx], ok[idx], tok[idx], maj_tokens, maj_ok,
                                  folds_of(mask), dv)
                    served[(name, label)] = (
                        figures(s, mask, maj_ok, maj_tokens),
                        [rule_text(grid.t[idx], grid.c[idx], grid.most[idx], h, a.k)
                         for h in s.rules])
            picked = min(tables, key=lambda nm: served[(nm, "old")][0]["tokens"])
            print(f"**delta_vote {dv:g}, path: {path}** (5-fold cross-fitting within each set; "
                  f"the launch with the fewest tokens on the old prompts: {picked})\n")
            print(head("prompts (rule per fold)", "(b)"))
            for label, mask in parts(rec):
                f, rules = served[(picked, label)]
                b = (f["accuracy"] > single_ok[mask].mean()
                     and f["tokens"] <= 1.5 * single_tokens[mask].mean()
                     and f["vote_error"] <= dv)
                print(line(f"{label} ({'; '.join(rules)})", f, one) + f" {'met' if b else '-'} |")
            for name in tables:
                for label, _ in parts(rec):
                    f, rules = served[(name, label)]
                    report["rows"].append({"delta_vote": dv, "path": path, "launch": name,
                                           "prompts": label, "picked_on_old": name == picked,
                                           "rules": rules, **f})
            cheapest = {label: min(tables, key=lambda nm: served[(nm, label)][0]["tokens"])
                        for label, _ in parts(rec)}
            print("\nThe cheapest launch per set, picked after the fact: " + "; ".join(
                f"{label}: {nm} at {served[(nm, label)][0]['tokens']:,.0f} tokens, accuracy "
                f"{served[(nm, label)][0]['accuracy']:.3f}" for label, nm in cheapest.items())
                + "\n")
    summary(report, single_ok, single_tokens, [label for label, _ in parts(rec)], rec)
    frontier(tables, single_ok, single_tokens, grid, report)
    (run_dir(a.reasoner, a.k) / "holdout-cap.json").write_text(json.dumps(report, indent=1))


def summary(report: dict, single_ok: np.ndarray, single_tokens: np.ndarray, labels: list[str],
            rec: Recording) -> None:
    """One line per (delta_vote, path): the launch picked on the old prompts, on each set
    (accuracy / tokens / vote error), and whether (b) holds there: accuracy above single's, at
    <= 1.5x its tokens, vote error <= delta_vote."""
    masks = dict(parts(rec))
    print("| delta_vote | path | launch (picked on old) | " + " | ".join(
        f"{x}: accuracy / tokens / != maj@k" for x in labels) + " |")
    print("|" + " --- |" * (3 + len(labels)))
    keys = sorted({(r["delta_vote"], r["path"]) for r in report["rows"]},
                  key=lambda x: (x[0], x[1] != CAPS_LAST))
    for dv, path in keys:
        rows = {r["prompts"]: r for r in report["rows"] if r["delta_vote"] == dv
                and r["path"] == path and r["picked_on_old"]}
        cells = []
        for x in labels:
            r, m = rows[x], masks[x]
            b = (r["accuracy"] > single_ok[m].mean() and r["vote_error"] <= dv
                 and r["tokens"] <= 1.5 * single_tokens[m].mean())
            lo, hi = r["vote_error_ci"]
            cells.append(f"{r['accuracy']:.3f} / {r['tokens']:,.0f} / {r['vote_error']:.3f} "
                         f"[{lo:.3f}, {hi:.3f}]{' (b) met' if b else ''}")
        print(f"| {dv:g} | {path} | {rows[labels[0]]['launch']} | " + " | ".join(cells) + " |")
    print()


def frontier(tables: dict, single_ok: np.ndarray, single_tokens: np.ndarray, grid: CapGrid,
             report: dict) -> None:
    """In sample, over all prompts: per launch, among every hypothesis of the grid whose
    accuracy is above single full reasoning's at <= 1.5x its tokens, the least vote error: what
    delta_vote (b) needs at the least, whatever the path."""
    acc1, tok1 = float(single_ok.mean()), float(single_tokens.mean())
    print(f"**(b) in sample, all prompts** (single {acc1:.3f} at {tok1:,.0f} tokens; 1.5x = "
          f"{1.5 * tok1:,.0f}): per launch, of the grid's hypotheses within 1.5x single's tokens "
          "and above its accuracy, the one with the least vote error\n")
    print("| launch | hypothesis | accuracy | tokens / prompt | != maj@k (95% CI) |")
    print("| --- | --- | --- | --- | --- |")
    for name, (err, ok, tok) in tables.items():
        fit = (tok.mean(axis=1) <= 1.5 * tok1) & (ok.mean(axis=1) > acc1)
        if not fit.any():
            print(f"| {name} | none within 1.5x single's tokens above its accuracy | | | |")
            continue
        h = int(np.flatnonzero(fit)[np.argmin(err.mean(axis=1)[fit])])
        e, n = int(err[h].sum()), err.shape[1]
        lo, hi = clopper_pearson(e, n)
        rule = rule_text(grid.t, grid.c, grid.most, h, grid.k)
        print(f"| {name} | {rule} | {ok[h].mean():.3f} | {tok[h].mean():,.0f} | {e}/{n} = "
              f"{e / n:.3f} [{lo:.3f}, {hi:.3f}] |")
        report.setdefault("frontier", []).append(
            {"launch": name, "rule": rule, "accuracy": float(ok[h].mean()),
             "tokens": float(tok[h].mean()), "vote_errors": e, "n": n})
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn in (("check", cmd_check), ("cap", cmd_cap)):
        s = sub.add_parser(name)
        s.add_argument("--reasoner", choices=sorted(REASONERS), default="long")
        s.add_argument("--k", type=int, default=8, help="samples per prompt")
        s.add_argument("--old", type=int, default=100,
                       help="prompts numbered below this are the first recording's")
        s.set_defaults(fn=fn)
        if name == "cap":
            s.add_argument("--deltas-vote", type=float, nargs="+",
                           default=list(CAP_DELTAS_VOTE))
    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
