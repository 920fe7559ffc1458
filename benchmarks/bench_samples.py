"""Parallel samples, offline (issue 35): accuracy against tokens per prompt, k samples a prompt.

Two subcommands.

``collect``: k full traces per prompt of held-out prompts (a seed no calibration saw), recorded by
the calibration job's own collector (orca_calibrate/collect.py, the plugin in record mode, an
answer probe at every step boundary) with the reasoner's job settings (orca_calibrate/jobs/
<reasoner>.yaml, `samples: k`). It works in rounds of a few batches and stops cleanly once
``--budget-s`` has passed, so each run fits a slot of the shared vLLM lock; a rerun resumes
(the trajectory writer skips what it holds), and a rerun with a larger ``--n`` extends the
prompts along the same seeded stream (`extend_prompts`: the recorded ones stay byte for byte). Run it under ``flock /tmp/vllm.lock``.
``--family`` records another prompt family of the task (the same seed); with ``--k 1`` that
is what benchmarks/bench_replay_shift.py replays.

``report``: every rule below computed from the recorded traces (no engine); tokens are
completion tokens (reasoning through the stop step plus the answer written after it):

- **single**: one full trace, as the mean over the k samples (less variance than sample 0);
- **maj@k**: the plurality of the k full traces' final answers (ties to the lowest sample);
- **ORCA + full vote**: each sample stops where the reasoner's shipped bundle stops it (its probe
  replayed on the recorded step embeddings, the server's code path), answers the probed answer
  at that step; the group votes over all k;
- **ORCA + consensus**: as above, but the group ends once the consensus rule (orca_method/
  consensus.py) is settled at its certified t; the samples still running are charged the tokens
  they wrote until then. All k launched at once, or in waves (``WAVES``, ``--waves``: each wave
  once the ones before have finished and left the vote open); score or count weights; per-sample
  stops at the bundle's lambda*, at stricter lambdas that carry its smallest delta's certificate
  (``STRICTER_LAMS``), and "no per-sample stop": the consensus alone over full samples. Latency:
  waves launched, and the group's end on the critical path. And one launch **chosen on data**
  without touching its certificate: per fold, another fold chooses, the remaining ones certify;
- **Adaptive-Consistency**: full samples one at a time until the Beta criterion on the top two
  counts is met; **ESC**: windows of full samples until one window is unanimous;
- **thinking budget x k**: each trace cut at its last step boundary within B reasoning tokens,
  answering the answer probe recorded there (the job's suffix, the long reasoner's own stop
  text); the group votes. vLLM's budget cuts at exactly B tokens, this at the boundary before.

DeepConf's confidence filtering needs token log-probabilities, which the traces do not carry.
The consensus t is certified on half of the prompts and applied to the other half, then the
halves swap (two-fold cross-calibration; `--folds F`: on F - 1 of F folds, for few prompts):
every prompt is judged by a t that never saw it, so
the realized vote error is over all n prompts; 200 random halves add how often the test half's
error stays within delta_vote. The per-sample lambda* come from the shipped bundle, calibrated on
other prompts, so the groups that certify t did not choose lambda*.

``serve``: the same through one live orca-serve (issue 35 item 2): the shipped bundle plus a
consensus block certified on every group ``collect`` recorded, fresh prompts (another seed) at a
fixed concurrency, three arms side by side on the same prompts and seeds (the arms' order
alternated per round): maj@k as k full samples (``n: k``, orca off), ORCA per sample with a full
vote (``n: k``), and ``orca.samples: k`` (the consensus stop, the samples still running aborted
in the engine). Requests/s per round, completion tokens per prompt (aborted samples' tokens
included), accuracy, and how often the answer differs from the maj@k arm's on the same prompt
(the same k samples: choice i of ``n`` and sample i both get seed + i). With
``--vote-audit-rate R`` the server audits that share of the voted groups (docs/AUDIT.md, "The
vote's audit": they abort nothing and run to their end after their answer); each arm then also
reports the tokens the engine generated (vLLM's `vllm:generation_tokens_total`, read once every
audited sample has ended), and the run the vote audit's table (GET /v1/orca/audit).

Usage:
  flock /tmp/vllm.lock python benchmarks/bench_samples.py collect --reasoner long --n 160 --k 8
  python benchmarks/bench_samples.py report --reasoner long
  flock /tmp/vllm.lock python benchmarks/bench_samples.py serve --reasoner toy --k 8 --n 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import beta as beta_dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orca_calibrate.collect import Collector, CollectSettings, read_prompts
from orca_calibrate.consensus import replayed, sample_groups, stopped_groups
from orca_calibrate.evaluate import interval95 as clopper_pearson
from orca_calibrate.job import load_job
from orca_demo.long import tasks as long_tasks
from orca_demo.toy import tasks as toy_tasks
from orca_method.bundle import load_bundle
from orca_method.consensus import (
    Group,
    confident_path,
    default_grid,
    format_waves,
    launched,
    outcomes,
    parse_waves,
    plurality,
    prompt_of,
    settle_events,
    vote_path,
)
from orca_method.consensus_ltt import calibrate_consensus
from orca_method.ltt import binomial_pvalues, n_rejected, split_replay
from orca_method.outcomes import Weighting
from orca_method.thresholds import NEVER
from orca_method.trajectories import Problem, TrajectorySet

PROMPT_SEED = 35  # calibration: seeds 1-3; goodput: 18; frontier: 31. These prompts are held out.
REASONERS = {"toy": (toy_tasks, "orca_serve/demo/bundle.json"),
             "long": (long_tasks, "orca_serve/demo/long/bundle.json")}
RUNS = ROOT / "runs" / "bench-samples"


def run_dir(reasoner: str, k: int, family: str = "in-dist") -> Path:
    """Where one collection lives; the in-distribution one keeps its original name."""
    return RUNS / (f"{reasoner}-k{k}" if family == "in-dist" else f"{reasoner}-{family}-k{k}")


def extend_prompts(prompts_file: Path, write: Callable[[Path], None]) -> None:
    """Write the prompts, or, when the file holds fewer than `write` writes, extend it along the
    same seeded stream: the traces already recorded stay keyed to their prompts, so the new file
    must start with the old one byte for byte (refused otherwise, and the old file kept)."""
    if not prompts_file.exists():
        write(prompts_file)
        return
    fresh = prompts_file.with_suffix(".new")
    write(fresh)
    old, new = prompts_file.read_bytes(), fresh.read_bytes()
    if len(new) <= len(old):
        fresh.unlink()
        return
    if not new.startswith(old):
        fresh.unlink()
        raise SystemExit(f"{prompts_file}: the prompt stream no longer starts with the recorded "
                         "prompts; not extended")
    fresh.replace(prompts_file)
    was, now = old.count(b"\n"), new.count(b"\n")
    print(f"{prompts_file}: extended from {was} to {now} prompts (the first {was} byte for byte)",
          flush=True)


def cmd_collect(a: argparse.Namespace) -> None:
    t0 = time.monotonic()
    tasks, _ = REASONERS[a.reasoner]
    out = run_dir(a.reasoner, a.k, a.family)
    out.mkdir(parents=True, exist_ok=True)
    prompts_file = out / "prompts.jsonl"
    extend_prompts(prompts_file, lambda path: tasks.write_prompts(path, a.family, a.n, PROMPT_SEED))
    prompts = read_prompts(prompts_file)[:a.n]
    job = load_job(ROOT / "orca_calibrate" / "jobs" / f"{a.reasoner}.yaml")
    settings = CollectSettings(**{**job["collect"], "samples": a.k,
                                  **({"batch": a.batch} if a.batch else {})})
    per_round = max(1, settings.batch // a.k)  # prompts per generation batch
    with Collector(job["model"], settings) as collector:
        for i in range(0, len(prompts), per_round):
            if time.monotonic() - t0 > a.budget_s:
                print(f"budget spent: stopped before prompt {i} of {len(prompts)}; rerun to resume",
                      flush=True)
                break
            collector.run(prompts[i:i + per_round], out / "trajectories", progress=False)
            print(f"{min(i + per_round, len(prompts))}/{len(prompts)} prompts, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
        (out / f"collect-stats-{int(time.time())}.json").write_text(
            json.dumps(collector.stats.as_dict(), indent=1))


# ------------------------------------------------------------------------------------ report

DELTAS_VOTE = (0.05, 0.1, 0.15)
EPSILON = 0.05
FOLD_SEED = 0
ADAPTIVE_CONFIDENCE = (0.8, 0.95)  # Adaptive-Consistency's Beta criterion levels
ESC_WINDOWS = (2, 4)
# the consensus with samples launched in waves (k = 8; --waves): pairs, or one sample first
WAVES = ((2, 2, 4), (2, 2, 2, 2), (1, 1, 2, 4), (1,) * 8)
# per-sample lambdas above the smallest delta's lambda*: fixed-sequence testing rejected every
# grid lambda from the top down to lambda*(delta), so each carries delta's certificate too, and
# its stopped answers differ from their own ends less often (a stricter stop inside the vote)
STRICTER_LAMS = (0.9, 0.95)
# the confidence clause (one early, short stop settles the vote: orca_method/consensus.py) beside
# the margin alone, per weighting; with count weights, where the margin's floor is two samples
CONFIDENT = {"count": (False, True), "score": (False,)}
REPS = 200  # random calibration / test halves per consensus arm
BUDGETS = {"toy": (40, 80, 120, 160, 240), "long": (250, 500, 1000, 1500, 2000, 3000)}


@dataclass(frozen=True)
class Trace:
    """One full sample as recorded: per-step cumulative reasoning tokens and probed answers,
    its final answer, and the tokens it wrote outside its steps (its answer)."""

    cum: np.ndarray  # [T]
    step_answers: list[str | None]
    final: str | None
    completion: int

    @property
    def answer_tokens(self) -> int:
        return max(self.completion - int(self.cum[-1]), 0)


@dataclass
class Arm:
    name: str
    correct: list[bool]
    tokens: list[float]
    vote_error: list[bool] | None = None  # the answer is not maj@k of the full samples
    # latency of a consensus arm: waves launched, and the group's end in its clock (tokens one
    # sample decodes on the critical path: a wave costs the longest of its samples)
    waves: list[int] | None = None
    span: list[float] | None = None

    def row(self, maj_tokens: float) -> dict:
        n = len(self.correct)
        out = {"arm": self.name, "n": n, "accuracy": float(np.mean(self.correct)),
               "accuracy_ci": wilson(int(np.sum(self.correct)), n),
               "tokens": float(np.mean(self.tokens)),
               "tokens_vs_maj": float(np.mean(self.tokens) / maj_tokens)}
        if self.vote_error is not None:
            e = int(np.sum(self.vote_error))
            out |= {"vote_errors": e, "vote_error": e / n, "vote_error_ci": clopper_pearson(e, n)}
        if self.waves is not None and self.span is not None:
            out |= {"waves_mean": float(np.mean(self.waves)), "waves_max": int(max(self.waves)),
                    "span": float(np.mean(self.span))}
        return out

    def settle(self, g: Group, group: list[Trace], truth: str, t: float | None,
               cap: float | None = None) -> None:
        """Add one group of a consensus arm, settled at margin t and cap (`settled`)."""
        assert self.vote_error is not None and self.waves is not None and self.span is not None
        answer, tokens, waves, span = settled(g, group, t, cap)
        self.correct.append(answer == truth)
        self.tokens.append(tokens)
        self.vote_error.append(answer != g.reference)
        self.waves.append(waves)
        self.span.append(span)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    mid, half = (p + z * z / (2 * n)), z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (float((mid - half) / (1 + z * z / n)), float((mid + half) / (1 + z * z / n)))


def prompt_number(ts: TrajectorySet, group: list[int]) -> int:
    """A group's prompt's place in its seeded stream (ids `<prefix>-<n>`, the task's
    write_prompts): the first 100 of an extended recording are the ones recorded first."""
    return int(prompt_of(ts.problems[group[0]].id)[0].rsplit("-", 1)[1])


def traces(ts: TrajectorySet, groups: list[list[int]]) -> list[list[Trace]]:
    def trace(p: Problem) -> Trace:
        return Trace(cum=np.cumsum(p.step_tokens), step_answers=p.step_answers,
                     final=p.final_answer, completion=int((p.extra or {})["completion_tokens"]))

    return [[trace(ts.problems[i]) for i in g] for g in groups]


def sequential(group: list[Trace],
               done: Callable[[list[Hashable]], bool]) -> tuple[Hashable, float]:
    """Draw full samples one after another until `done(answers so far)`: (vote, tokens)."""
    answers: list[Hashable] = []
    for tr in group:
        answers.append(tr.final)
        if done(answers):
            break
    return plurality(answers), float(sum(tr.completion for tr in group[:len(answers)]))


def adaptive_consistency(level: float) -> Callable[[list[Hashable]], bool]:
    """Adaptive-Consistency's Beta stopping criterion: stop once P(p_1 > p_2 | the top two
    counts) >= level, with p_1 ~ Beta(c_1 + 1, c_2 + 1)."""
    def done(answers: list[Hashable]) -> bool:
        counts = sorted((answers.count(a) for a in set(answers)), reverse=True) + [0]
        return float(beta_dist.sf(0.5, counts[0] + 1, counts[1] + 1)) >= level
    return done


def esc(window: int) -> Callable[[list[Hashable]], bool]:
    """Early-Stopping Self-Consistency: samples in windows of `window`; stop after a window
    whose answers all agree."""
    def done(answers: list[Hashable]) -> bool:
        n = len(answers)
        return n % window == 0 and len(set(answers[n - window:])) == 1
    return done


def budget_answer(tr: Trace, budget: int) -> tuple[str | None, float]:
    """The thinking budget, offline: the trace cut at its last step boundary within `budget`
    reasoning tokens, its answer the probe there (None when no step fits); a trace within the
    budget runs to its end."""
    if tr.cum[-1] <= budget:
        return tr.final, float(tr.completion)
    t = int(np.searchsorted(tr.cum, budget, side="right")) - 1
    if t < 0:
        return None, float(budget + tr.answer_tokens)
    return tr.step_answers[t], float(tr.cum[t] + tr.answer_tokens)


def hypotheses(confident: bool, k: int) -> tuple[np.ndarray, np.ndarray | None]:
    """LTT's path: the margin t alone, or (t, c) with the confidence clause (`confident_path`)."""
    return confident_path(k) if confident else (default_grid(), None)


def consensus_arm(name: str, stopped: list[Group], full: list[list[Trace]], truth: list[str],
                  folds: np.ndarray, delta_vote: float,
                  confident: bool = False) -> tuple[Arm, list[tuple[float | None, float | None]]]:
    """The consensus stop with t (and c, `confident`) certified on the other folds
    (cross-calibration: each group is judged by a rule certified without it); a group's tokens
    are its samples' until it settles plus the answers of those finished."""
    grid, caps = hypotheses(confident, len(full[0]))
    rule_of = {}
    for f in sorted(set(folds.tolist())):
        cal = [g for g, fold in zip(stopped, folds) if fold != f]
        (res,) = calibrate_consensus(cal, [delta_vote], epsilon=EPSILON, grid=grid, caps=caps)
        rule_of[f] = (res.t, res.cap)
    arm = Arm(name, [], [], [], [], [])
    for g, group, ref_truth, fold in zip(stopped, full, truth, folds):
        arm.settle(g, group, ref_truth, *rule_of[fold])
    return arm, list(rule_of.values())


def settled(g: Group, group: list[Trace], t: float | None,
            cap: float | None = None) -> tuple[Hashable, float, int, float]:
    """(answer, tokens, waves launched, end time) of one group at margin t and cap (None: no
    confidence clause). t None (not certified): every sample runs to its end, launched at once,
    and the vote is maj@k."""
    if t is None:
        return (g.reference, float(sum(tr.completion for tr in group)), 1,
                float(max(tr.completion for tr in group)))
    path = vote_path(g)
    e = int(settle_events(path, np.array([t]), None if cap is None else np.array([cap]))[0])
    at = float(path.times[e])
    start = np.zeros(len(group)) if g.start is None else g.start
    tokens = g.spent(at) + sum(tr.answer_tokens for tr, f in zip(group, g.finish) if f <= at)
    # a wave due when the vote settles (its start == the settling finish) is never launched
    return path.leaders[e], tokens, len(np.unique(start[start < at])), at


def selected_arm(candidates: dict[tuple[str, bool], list[Group]], full: list[list[Trace]],
                 truth: list[str], folds: np.ndarray, delta_vote: float
                 ) -> tuple[Arm, list[tuple[str, float | None, float | None]]]:
    """The launch chosen on data, with the certificate kept valid: for test fold f, fold f + 1
    chooses the candidate (per-sample stop, weighting, wave schedule, and whether one confident
    sample may settle) and the other folds, which chose nothing, certify its rule. The choice:
    the fewest tokens on the choosing fold at the hypothesis that LTT would certify on as many
    groups as certify, were their vote errors at the choosing fold's rates (a plug-in guess: any
    choice keeps the certificate valid, since the certifying groups did not see it; a poor
    guess costs tokens, never error)."""
    k, names = len(full[0]), list(candidates)
    F = int(folds.max()) + 1
    arm, chosen = Arm(f"chosen on another fold + consensus (delta_vote {delta_vote:g})",
                      [], [], [], [], []), []
    by_fold: dict[int, tuple[tuple[str, bool], float | None, float | None]] = {}
    for f in range(F):
        pick = (f + 1) % F
        n_cert = int(np.sum((folds != f) & (folds != pick)))
        cost = []
        for name in names:
            grid, caps = hypotheses(name[1], k)
            loss, tokens = outcomes([g for g, x in zip(candidates[name], folds) if x == pick],
                                    grid, caps)  # [m, n_pick]
            counts = np.round(loss.mean(axis=1) * n_cert).astype(np.int64)  # [m]
            last = n_rejected(binomial_pvalues(counts, n_cert, delta_vote), EPSILON) - 1
            at_end = float(np.mean([g.spent(np.inf) for g, x in zip(candidates[name], folds)
                                    if x == pick]))
            cost.append(at_end if last < 0 else float(tokens[last].mean()))
        name = names[int(np.argmin(cost))]
        cal = [g for g, x in zip(candidates[name], folds) if x not in (f, pick)]
        grid, caps = hypotheses(name[1], k)
        (res,) = calibrate_consensus(cal, [delta_vote], epsilon=EPSILON, grid=grid, caps=caps)
        by_fold[f] = (name, res.t, res.cap)
        chosen.append((name[0] + (" + one confident sample" if name[1] else ""), res.t, res.cap))
    for j, (grp, y, f) in enumerate(zip(full, truth, folds)):
        name, t, cap = by_fold[int(f)]
        arm.settle(candidates[name][j], grp, y, t, cap)
    return arm, chosen


def random_splits(stopped: list[Group], delta_vote: float, reps: int = REPS,
                  confident: bool = False) -> dict:
    """Certify t (and c) on a random half of the groups, read its vote error on the other half,
    `reps` times (seeded): how often the realized error is <= delta_vote, over draws of the data
    rather than the one cross-calibration above."""
    grid, caps = hypotheses(confident, len(stopped[0].answers))
    loss, _ = outcomes(stopped, grid, caps)  # [m, n]
    row = split_replay(loss, len(stopped) // 2, [delta_vote], EPSILON, reps=reps,
                       seed=FOLD_SEED).row(0)
    return {"reps": reps, "mean_error": row["mean_error"], "p95_error": row["p95_error"],
            "share_within_delta": 1.0 - row["share_above_delta"]}


def cmd_report(a: argparse.Namespace) -> None:
    out = run_dir(a.reasoner, a.k)
    ts = TrajectorySet.open(out / "trajectories")
    groups = sample_groups(ts, list(range(len(ts))))
    groups = [g for g in groups if len(g) == a.k]
    if a.n:  # by the prompts' place in their stream (groups come sorted by id, "-10" before "-2")
        groups = [g for g in groups if prompt_number(ts, g) < a.n]
    bundle = load_bundle(ROOT / REASONERS[a.reasoner][1])
    probe = bundle.load_probe()
    full = traces(ts, groups)
    truth = [ts.problems[g[0]].answer for g in groups]
    n = len(groups)
    folds = np.random.default_rng(FOLD_SEED).permutation(n) % a.folds
    maj = [plurality([tr.final for tr in grp]) for grp in full]
    arms = [
        Arm("single full reasoning (mean over the k samples)",
            [float(np.mean([tr.final == y for tr in grp])) for grp, y in zip(full, truth)],
            [float(np.mean([tr.completion for tr in grp])) for grp in full]),
        Arm(f"maj@{a.k} of full traces", [m == y for m, y in zip(maj, truth)],
            [float(sum(tr.completion for tr in grp)) for grp in full],
            [False] * n),
    ]
    for level in ADAPTIVE_CONFIDENCE:
        res = [sequential(grp, adaptive_consistency(level)) for grp in full]
        arms.append(Arm(f"Adaptive-Consistency (Beta, {level})",
                        [r[0] == y for r, y in zip(res, truth)],
                        [r[1] for r in res], [r[0] != m for r, m in zip(res, maj)]))
    for w in ESC_WINDOWS:
        res = [sequential(grp, esc(w)) for grp in full]
        arms.append(Arm(f"ESC (window {w})", [r[0] == y for r, y in zip(res, truth)],
                        [r[1] for r in res], [r[0] != m for r, m in zip(res, maj)]))
    for b in BUDGETS[a.reasoner]:
        res = [[budget_answer(tr, b) for tr in grp] for grp in full]
        votes = [plurality([r[0] for r in rr]) for rr in res]
        arms.append(Arm(f"thinking budget {b} x {a.k}", [v == y for v, y in zip(votes, truth)],
                        [sum(r[1] for r in rr) for rr in res],
                        [v != m for v, m in zip(votes, maj)]))
    certified, scores = {}, replayed(probe, ts, groups, bundle.window)
    candidates: dict[tuple[str, bool], list[Group]] = {}  # every launch, for `selected_arm`
    stops = [(f"ORCA delta {r.delta:g}", bundle.lam(r.delta)) for r in bundle.ltt.rows]
    strict = min(r.delta for r in bundle.ltt.rows)
    stops += [(f"ORCA lambda {lam:g} (delta {strict:g}'s certificate)", lam)
              for lam in STRICTER_LAMS if lam > bundle.lam(strict)]
    stops.append(("no per-sample stop", NEVER))  # the consensus alone, over full samples
    for label, lam in stops:
        for weighting in Weighting:
            stopped = stopped_groups(ts, groups, scores, lam, weighting)
            if weighting == Weighting.SCORE and lam < NEVER:  # the plain vote of the stopped samples
                votes = [plurality(g.answers) for g in stopped]
                tokens = [float(g.finish.sum()) + sum(tr.answer_tokens for tr in grp)
                          for g, grp in zip(stopped, full)]
                stop_err = float(np.mean([ans != tr.final for g, grp in zip(stopped, full)
                                          for ans, tr in zip(g.answers, grp)]))
                arm = Arm(f"{label} + full vote",
                          [v == y for v, y in zip(votes, truth)], tokens,
                          [v != m for v, m in zip(votes, maj)])
                arms.append(arm)
                certified[f"{label} per-sample stop error"] = stop_err
            launches = {"parallel": stopped}
            for waves in a.waves:
                if sum(waves) == a.k:
                    launches[f"waves {format_waves(waves)}"] = launched(stopped, waves)
            for launch, groups_ in launches.items():
                for confident in CONFIDENT[weighting]:
                    candidates[(f"{label}, {weighting}, {launch}", confident)] = groups_
                for dv, confident in [(dv, c) for c in CONFIDENT[weighting] for dv in DELTAS_VOTE]:
                    rule = " + one confident sample" if confident else ""
                    arm, used = consensus_arm(
                        f"{label} + consensus{rule} ({weighting}, {launch}, delta_vote {dv:g})",
                        groups_, full, truth, folds, dv, confident)
                    arms.append(arm)
                    certified[arm.name] = {
                        "t_per_fold": [t for t, _ in used],
                        "cap_per_fold": [c for _, c in used],
                        "random_halves": random_splits(groups_, dv, confident=confident)}
    for dv in DELTAS_VOTE:
        arm, chosen = selected_arm(candidates, full, truth, folds, dv)
        arms.append(arm)
        certified[arm.name] = {"t_per_fold": [t for _, t, _ in chosen],
                               "cap_per_fold": [c for _, _, c in chosen],
                               "chosen_per_fold": [name for name, _, _ in chosen],
                               "random_halves": None}
    maj_tokens = float(np.mean(arms[1].tokens))
    rows = [arm.row(maj_tokens) for arm in arms]
    report = {"reasoner": a.reasoner, "k": a.k, "n": n, "epsilon": EPSILON,
              "bundle": REASONERS[a.reasoner][1],
              "lambdas": {f"{r.delta:g}": r.lam for r in bundle.ltt.rows},
              "t_per_fold": certified, "rows": rows}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    single = rows[0]
    one_span = float(np.mean([tr.cum[-1] for grp in full for tr in grp]))  # one sample's clock
    print(f"**{a.reasoner}, in-dist, k = {a.k}** (n = {n} prompts; epsilon = {EPSILON}; "
          f"single full reasoning {single['tokens']:.0f} tokens, accuracy "
          f"{single['accuracy']:.3f}; "
          f"maj@{a.k} {rows[1]['tokens']:.0f} tokens, accuracy {rows[1]['accuracy']:.3f})\n")
    print("| arm | accuracy (95% CI) | tokens / prompt | x maj@k tokens | x single | "
          "differs from maj@k (95% CI) | waves mean / max | end, x one sample |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ve = "-" if "vote_error" not in r else (
            f"{r['vote_errors']}/{r['n']} = {r['vote_error']:.3f} "
            f"[{r['vote_error_ci'][0]:.3f}, {r['vote_error_ci'][1]:.3f}]")
        lat = ("- | -" if "span" not in r else f"{r['waves_mean']:.2f} / {r['waves_max']} | "
               f"{r['span'] / one_span:.2f}")
        print(f"| {r['arm']} | {r['accuracy']:.3f} [{r['accuracy_ci'][0]:.3f}, "
              f"{r['accuracy_ci'][1]:.3f}] | {r['tokens']:.0f} | {r['tokens_vs_maj']:.2f} | "
              f"{r['tokens'] / single['tokens']:.2f} | {ve} | {lat} |")
    print()
    for name, v in certified.items():
        if isinstance(v, float):
            print(f"- {name}: {v:.3f}")
            continue
        h = v["random_halves"]
        t = ", ".join("none" if x is None else f"{x:.2f}" for x in v["t_per_fold"])
        if h is None:
            print(f"- {name}: per fold (chosen, t, cap): "
                  f"{list(zip(v['chosen_per_fold'], v['t_per_fold'], v['cap_per_fold']))}")
            continue
        if any(c is not None for c in v.get("cap_per_fold", [])):
            t += "; cap c per fold [" + ", ".join(
                "off" if c is None else f"{c:.0f}" for c in v["cap_per_fold"]) + "]"
        print(f"- {name}: t per fold [{t}]; {h['reps']} random halves: vote error mean "
              f"{h['mean_error']:.3f}, 95th percentile {h['p95_error']:.3f}, <= delta_vote in "
              f"{h['share_within_delta']:.3f}")
    print("\nIssue 35's 'Done means', consensus arms only:")
    maj, one = rows[1], single
    for r in rows:
        if "consensus" not in r["arm"]:
            continue
        dv = float(r["arm"].rsplit(" ", 1)[1].rstrip(")"))
        near_maj = r["accuracy"] >= maj["accuracy"] - 0.02 and r["tokens_vs_maj"] <= 0.4
        beats_one = r["accuracy"] > one["accuracy"] and r["tokens"] <= 1.5 * one["tokens"]
        print(f"- {r['arm']}: within 2 points of maj@k at <= 40% of its tokens: {near_maj}; "
              f"beats single at <= 1.5x its tokens: {beats_one}; vote error {r['vote_error']:.3f} "
              f"<= {dv:g}: {r['vote_error'] <= dv} (95% upper {r['vote_error_ci'][1]:.3f})")


# -------------------------------------------------------------------------------------- serve

SERVE_SEED = 135  # fresh prompts: neither the traces that certify t (35) nor calibration saw them


def serve_bundle(a: argparse.Namespace, out: Path) -> Path:
    """The shipped bundle plus a consensus block certified on every recorded group of
    `collect` (held-out prompts, not the ones served): sealed under runs/, the shipped bundle
    untouched."""
    from orca_calibrate.consensus import ConsensusOptions, consensus_block
    from orca_method.bundle import save_bundle

    ts = TrajectorySet.open(run_dir(a.reasoner, a.k) / "trajectories")
    bundle = load_bundle(ROOT / REASONERS[a.reasoner][1])
    block = consensus_block(bundle, bundle.load_probe(), ts, list(range(len(ts))),
                            ConsensusOptions(deltas=(a.delta_vote,), epsilon=EPSILON))
    path = out / "bundle.json"
    save_bundle(bundle.model_copy(update={"consensus": block}), path)
    return path


async def serve_arm(srv, model: str, prompts: list[dict], a: argparse.Namespace,
                    orca: dict, n: int, offset: int = 0) -> dict:
    """Every prompt once at `a.concurrency` requests in flight: per prompt its answer (the
    voted one; for n > 1 the plurality of its choices), completion tokens and per-choice
    answers; and the arm's wall time. Prompt j is seeded 1000 * j: vLLM seeds choice i of `n`
    with seed + i, the server sample i of `orca.samples` too, so both arms draw the same k
    samples of a prompt (up to where ORCA stops one), and "!= maj@k" is the vote's loss."""
    from orca_method.answer_probes import answer_after

    sem = asyncio.Semaphore(a.concurrency)

    async def one(client, i: int, rec: dict) -> dict:
        async with sem:
            r = await client.chat.completions.create(
                model=model, messages=rec["messages"], n=n, max_tokens=a.max_tokens,
                temperature=a.temperature, seed=1000 * (offset + i),
                extra_body={"orca": orca})
        answers = [answer_after(c.message.content or "") for c in r.choices]
        o = (r.model_extra or {}).get("orca") or {}
        vote = o.get("vote")
        return {"answer": vote["answer"] if vote else plurality(answers), "choices": answers,
                "tokens": r.usage.completion_tokens, "vote": vote,
                # a sample not launched (waves) or still running (an audited group) has no
                # `aborted`
                "aborted": sum(x.get("aborted", False) for x in o.get("samples", []))}

    async with srv.aclient() as client:
        t0 = time.monotonic()
        rows = await asyncio.gather(*(one(client, i, rec) for i, rec in enumerate(prompts)))
        return {"wall_s": time.monotonic() - t0, "rows": rows}


def cmd_serve(a: argparse.Namespace) -> None:
    from tests.serving import Server, orca_serve_cmd

    out = run_dir(a.reasoner, a.k) / "serve"
    out.mkdir(parents=True, exist_ok=True)
    bundle_path = serve_bundle(a, out)
    block = load_bundle(bundle_path).consensus
    rows = [r for r in block.rows if r.delta == a.delta]
    print(f"consensus block: k {block.samples}, {block.n_cal} groups, rows "
          f"{[(r.delta, r.delta_vote, r.t) for r in block.rows]}", flush=True)
    prompts_file = out / "prompts.jsonl"
    REASONERS[a.reasoner][0].write_prompts(prompts_file, "in-dist", a.n, SERVE_SEED)
    prompts = read_prompts(prompts_file)
    model_dir = ROOT / REASONERS[a.reasoner][1].replace("bundle.json", "model")
    audit = ([] if not a.vote_audit_rate else
             ["--orca-vote-audit-rate", str(a.vote_audit_rate), "--orca-audit-seed", "0"])
    srv = Server(orca_serve_cmd("--model", str(model_dir), "--calib", str(bundle_path), *audit),
                 out / "serve.log", ["--host", "127.0.0.1", "--seed", "0",
                                     "--reasoning-parser", "deepseek_r1",
                                     "--served-model-name", load_bundle(bundle_path).model.name,
                                     "--disable-uvicorn-access-log"])
    arms = {f"maj@{a.k}, {a.k} full samples (n = {a.k}, orca off)": ({"enabled": False}, a.k),
            f"ORCA per sample + full vote (n = {a.k}, delta {a.delta:g})": (
                {"delta": a.delta}, a.k),
            f"consensus with aborts, orca.samples {a.k} (delta {a.delta:g})": (
                {"samples": a.k, "delta": a.delta}, 1)}
    if a.skip_orca_arm:
        del arms[list(arms)[1]]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    try:
        srv.wait()
        model = asyncio.run(_model(srv))
        order = list(arms)  # maj@k first: the other arms' "!= maj@k" reads its answers
        per = a.n // a.rounds
        for rnd in range(a.rounds):  # fresh prompts per round, the arms' order alternated
            part = prompts[rnd * per:(rnd + 1) * per]
            for name in (order if rnd % 2 == 0 else order[::-1]):
                orca, n = arms[name]
                before = engine_tokens(srv)
                runs[name].append(asyncio.run(serve_arm(srv, model, part, a, orca, n,
                                                        offset=rnd * per)))
                runs[name][-1]["engine_tokens"] = engine_tokens(srv) - before
                print(f"round {rnd}: {name}: {runs[name][-1]['wall_s']:.1f} s", flush=True)
        vote_audit = audit_table(srv).get("vote")
    finally:
        srv.stop()
    truth = [str(p["answer"]) for p in prompts[:per * a.rounds]]
    maj = [r["answer"] for x in runs[order[0]] for r in x["rows"]]
    table = []
    for name, rr in runs.items():
        rows_ = [r for x in rr for r in x["rows"]]
        n_ = len(rows_)
        correct = sum(r["answer"] == y for r, y in zip(rows_, truth))
        differs = sum(r["answer"] != m for r, m in zip(rows_, maj))
        rps = [per / x["wall_s"] for x in rr]
        table.append({"arm": name, "n": n_, "accuracy": correct / n_,
                      "accuracy_ci": wilson(correct, n_),
                      "tokens": float(np.mean([r["tokens"] for r in rows_])),
                      "requests_per_s": rps, "differs_from_served_maj": differs,
                      "differs_ci": clopper_pearson(differs, n_),
                      "aborted_per_prompt": float(np.mean([r["aborted"] for r in rows_])),
                      "engine_tokens": sum(x["engine_tokens"] for x in rr) / n_,
                      "audited": sum(bool(r["vote"]) and r["vote"]["audited"] for r in rows_),
                      "settled": sum(bool(r["vote"]) and r["vote"]["ended"] == "settled"
                                     for r in rows_)})
    result = {"date": started, "reasoner": a.reasoner, "k": a.k, "n": a.n,
              "concurrency": a.concurrency, "rounds": a.rounds, "delta": a.delta,
              "temperature": a.temperature, "max_tokens": a.max_tokens,
              "consensus_rows": [r.model_dump() for r in rows], "table": table, "runs": runs,
              "vote_audit_rate": a.vote_audit_rate, "vote_audit": vote_audit}
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"{started}; {a.reasoner}, k = {a.k}, n = {per * a.rounds} fresh prompts, concurrency "
          f"{a.concurrency}, {a.rounds} rounds of {per} (order alternated), temperature "
          f"{a.temperature}; consensus rows {[(r.delta_vote, r.t) for r in rows]}\n")
    print("| arm | accuracy (95% CI) | completion tokens / prompt | engine tokens / prompt | "
          "requests/s per round | aborted samples / prompt | settled early | audited | "
          "!= served maj@k (95% CI) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {r['arm']} | {r['accuracy']:.3f} [{r['accuracy_ci'][0]:.3f}, "
              f"{r['accuracy_ci'][1]:.3f}] | {r['tokens']:.0f} | {r['engine_tokens']:.0f} | "
              f"{', '.join(f'{x:.2f}' for x in r['requests_per_s'])} | "
              f"{r['aborted_per_prompt']:.2f} | {r['settled']}/{r['n']} | {r['audited']} | "
              f"{r['differs_from_served_maj']}/{r['n']} "
              f"[{r['differs_ci'][0]:.3f}, {r['differs_ci'][1]:.3f}] |")
    for row in (vote_audit or {}).get("rows", []):
        if row["n"]:
            errors = round(row["risk"] * (row["n"] - row["censored"]))
            lo, hi = clopper_pearson(errors, row["n"] - row["censored"])
            print(f"\nvote audit (rate {a.vote_audit_rate:g}): delta {row['delta']:g}, "
                  f"delta_vote {row['delta_vote']:g}, t {row['t']:g}: {row['n']} audited groups "
                  f"({row['censored']} censored), vote error {errors}/{row['n'] - row['censored']}"
                  f" [{lo:.3f}, {hi:.3f}] (95% CI), anytime-valid bounds [{row['lower']:.3f}, "
                  f"{row['upper']:.3f}], alarm {row['alarm']}")


def engine_tokens(srv, idle_s: float = 300) -> float:
    """vLLM's generated tokens so far (`vllm:generation_tokens_total`), read once the engine is
    idle and every audited group has ended (their samples run on after the answers)."""
    import httpx

    deadline = time.monotonic() + idle_s
    while True:
        lines = httpx.get(srv.url + "/metrics", timeout=10).text.splitlines()
        value = lambda name: sum(float(ln.rsplit(" ", 1)[1]) for ln in lines
                                 if ln.split("{", 1)[0].split(" ", 1)[0] == name)
        vote = audit_table(srv).get("vote") or {}
        open_audits = vote.get("picked", 0) - vote.get("measured", 0) - vote.get("censored", 0)
        if (value("vllm:num_requests_running") == 0 and open_audits == 0) \
                or time.monotonic() > deadline:
            return value("vllm:generation_tokens_total")
        time.sleep(0.5)


def audit_table(srv) -> dict:
    import httpx

    r = httpx.get(srv.url + "/v1/orca/audit", timeout=10)
    return r.json() if r.status_code == 200 else {}


async def _model(srv) -> str:
    async with srv.aclient() as client:
        return (await client.models.list()).data[0].id


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(required=True)
    c = sub.add_parser("collect", help="record k full traces per held-out prompt")
    c.add_argument("--reasoner", choices=sorted(REASONERS), required=True)
    c.add_argument("--n", type=int, default=160, help="prompts")
    c.add_argument("--k", type=int, default=8, help="samples per prompt")
    c.add_argument("--family", default="in-dist",
                   help="the task's prompt family (its FAMILIES); benchmarks/"
                   "bench_replay_shift.py replays the shifted and hard ones with k = 1")
    c.add_argument("--batch", type=int, default=0,
                   help="traces per generation batch (0: the job's); the tiny demo reasoners "
                   "run faster in larger batches")
    c.add_argument("--budget-s", type=float, default=1080,
                   help="stop cleanly after the round in flight once this has passed")
    c.set_defaults(fn=cmd_collect)
    r = sub.add_parser("report", help="every rule from the recorded traces")
    r.add_argument("--reasoner", choices=sorted(REASONERS), required=True)
    r.add_argument("--k", type=int, default=8, help="samples per prompt")
    r.add_argument("--n", type=int, default=0,
                   help="the stream's first n prompts only (0: all)")
    r.add_argument("--waves", nargs="+", default=list(WAVES),
                   type=parse_waves, metavar="A+B+...",
                   help="wave launches to report beside all-at-once (each summing to k)")
    r.add_argument("--folds", type=int, default=2,
                   help="cross-calibration folds: t for each fold is certified on the others "
                        "(n (F-1)/F groups; LTT certifies nothing at delta_vote 0.05 and "
                        "epsilon 0.05 with fewer than 59)")
    r.set_defaults(fn=cmd_report)
    s = sub.add_parser("serve", help="maj@k as k full samples vs orca.samples k with aborts, "
                       "through one live orca-serve (needs `collect` first: its traces certify t)")
    s.add_argument("--reasoner", choices=["toy"], default="toy")
    s.add_argument("--k", type=int, default=8, help="samples per prompt")
    s.add_argument("--n", type=int, default=120, help="fresh prompts, split over the rounds")
    s.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--delta", type=float, default=0.05, help="per-sample delta")
    s.add_argument("--delta-vote", type=float, default=0.05)
    s.add_argument("--temperature", type=float, default=0.7, help="the collection's")
    s.add_argument("--max-tokens", type=int, default=400, help="the collection's")
    s.add_argument("--vote-audit-rate", type=float, default=0.0,
                   help="the server's --orca-vote-audit-rate (0: no vote audit)")
    s.add_argument("--skip-orca-arm", action="store_true",
                   help="leave out the ORCA-per-sample arm (a shorter run)")
    s.set_defaults(fn=cmd_serve)
    a = p.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
