"""Issue 34's done-means on the long reasoner's shifted and hard families, replayed offline.

Serving one ORCA arm at one delta live and labelling it costs ~20 min of the shared machine per
family, too much for every delta of the bundle on two families. So the traces are recorded once,
in full (`bench_samples.py collect --family F --k 1`: the job's collector, plugin in record mode,
an answer probe at every step boundary, temperature 0.7, prompts seed 35 that no calibration
saw), and every arm is replayed from them through the server's own code path:

- the shipped bundle's probe with its online update on the recorded step embeddings
  (`orca_method.procedure.replay`, the `ProbeBank.step` the engine runs), never stopping: the
  scores up to any stop are the ones the server computes, so one replay serves every lambda;
- the shift gate (the defaults: on, the bundle's levels, action `strict`): its score of the
  mean of the first `gate.steps` step embeddings (`ShiftGate.score`, the engine's code) against
  the request's two thresholds (`ShiftGate.thresholds`, as the engine resolves them); before its
  gate step a request neither stops nor gives up; a flagged one runs with the bundle's largest
  lambda* (`--shift-action full`: none, full reasoning) and never gives up, nor does one above
  the give-up side's threshold (orca_serve/core/plan.py `_plan_scoring`, `ProbeBank.step`);
- the give-up probe (its own bank, no online update) and `two_sided_ends` (the stop wins a tie);
- `stop_indices` on the masked scores.

Per family and delta: the stop error (supervised labels, the live benchmarks' loss; and under
the bundle's own label mode, the loss LTT certified), the give-up error, accuracy and tokens of
one- and two-sided ORCA, the flag rate; all with exact 95% intervals (Clopper-Pearson, the
project's `interval95`) or Wilson's for accuracy. Beside them full reasoning and the thinking
budget at B tokens from the same traces (`bench_samples.budget_answer`: the trace cut at its
last step boundary within B reasoning tokens, the recorded answer probe there). vLLM's live
budget differs: it cuts at exactly B tokens, mid-step, and the model then writes its own answer
after the forced end of thinking, sampled at the request's temperature, where the replay answers
the job's suffix greedily at a step boundary before B.

The gate alarm (`--gate-alarm LEVEL`): the engine core's stream-level alarm
(orca_method/gate_alarm.py, orca_serve/core/gate_alarm.py) serves requests as flagged that the
per-request gate passed (`family_report(..., alarm=f)`: f gets the stream's gate decisions in
order and returns the serve-as-flagged mask). It hears a request's decision at the request's gate
step (`--alarm-at gate`, the default; `--alarm-at finish`: when the request finishes, as the
server's alarm did before), with `--in-flight` requests running (`alarm_lags`), and depends on
the arrival order, so it is replayed over `--orders` random orders of the family's requests,
from a fresh alarm at the first one (no in-distribution traffic before it). Not replayed: a
request already past its gate when the alarm rises switches to the flagged policy in the engine
(its stop can only come later); here it keeps its lambda*, so the errors are upper bounds.

In distribution (`--families in-dist`, e.g. the k = 8 collection of issue 35) it also prints
what the gate costs there: the one-sided tokens with the gate minus without, in points of full
reasoning's tokens, with 95% intervals from a bootstrap over prompts (k samples of a prompt are
not independent requests). `--reasoner toy` replays the toy's collections with its bundle.

Usage (after the collections):
  python benchmarks/bench_replay_shift.py            # every family collected
  python benchmarks/bench_replay_shift.py --families shifted --out runs/replay-shift
  python benchmarks/bench_replay_shift.py --families shifted --gate-alarm 0.01 --in-flight 32
  python benchmarks/bench_replay_shift.py --reasoner toy --families in-dist --k 8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_samples import (  # noqa: E402
    BUDGETS,
    REASONERS,
    Trace,
    budget_answer,
    run_dir,
    traces,
    wilson,
)
from bench_shift import against_budget  # noqa: E402

from orca_calibrate.evaluate import interval95  # noqa: E402
from orca_method.bundle import Bundle, load_bundle  # noqa: E402
from orca_method.consensus import prompt_of  # noqa: E402
from orca_method.gate_alarm import GateAlarm  # noqa: E402
from orca_method.give_up import last_right, lost_by_giving_up, two_sided_ends  # noqa: E402
from orca_method.labels import equivalent  # noqa: E402
from orca_method.outcomes import Ended, GiveUpPolicy  # noqa: E402
from orca_method.procedure import replay  # noqa: E402
from orca_method.risk import cumulative, stop_indices  # noqa: E402
from orca_method.shift_gate import ShiftGate, gate_features  # noqa: E402
from orca_method.thresholds import NEVER  # noqa: E402
from orca_method.trajectories import TrajectorySet  # noqa: E402
from orca_serve.settings.contract import DEFAULTS, ShiftAction, safe_lam  # noqa: E402

BUNDLE = ROOT / REASONERS["long"][1]  # the long reasoner's shipped bundle
FAMILIES = ("shifted", "hard")
GIVE_UP_DELTA = 0.05  # the two-sided arm's delta_2, as bench_frontier / bench_shift serve it
OUT = ROOT / "runs" / "replay-shift"

# A stream-level alarm: the per-request gate decisions of a stream, in order ([n] bool) -> which
# requests are served as flagged ([n] bool; at least the gate's own flags are)
StreamAlarm = Callable[[np.ndarray], np.ndarray]


@dataclass
class Replayed:
    """One family's recorded traces as the server scores them, never stopping."""

    stop: list[np.ndarray]  # smoothed stop scores, [T_i] each
    give_up: list[np.ndarray]  # smoothed give-up scores, [T_i] each
    gate_score: np.ndarray  # [n]; nan where the trace is too short to be gated
    traces: list[Trace]
    truth: list[str]
    supervised: list[np.ndarray]  # raw per-step labels against the reference answer
    certified: list[np.ndarray]  # cumulative labels of the bundle's label mode (LTT's loss)
    prompt: list[str] | None = None  # each trace's prompt id (k samples of a prompt share one)

    def __len__(self) -> int:
        return len(self.traces)

    def subset(self, idx: Sequence[int]) -> Replayed:
        """These requests, in this order (an arrival order, or a split)."""
        return Replayed(stop=[self.stop[i] for i in idx], give_up=[self.give_up[i] for i in idx],
                        gate_score=self.gate_score[np.asarray(idx, dtype=int)],
                        traces=[self.traces[i] for i in idx], truth=[self.truth[i] for i in idx],
                        supervised=[self.supervised[i] for i in idx],
                        certified=[self.certified[i] for i in idx],
                        prompt=None if self.prompt is None else [self.prompt[i] for i in idx])


def replay_family(bundle: Bundle, ts: TrajectorySet) -> Replayed:
    """Score every trace of `ts` as the server would (module docstring)."""
    idx = list(range(len(ts)))
    embs = [ts.embeddings(i) for i in idx]
    stop = [s.numpy().astype(np.float64)
            for _, s in replay(bundle.load_probe(), embs, window=bundle.window)]
    give_up = [s.numpy().astype(np.float64)
               for _, s in replay(bundle.load_give_up_probe(), embs,
                                  window=bundle.give_up.window)]
    return Replayed(stop=stop, give_up=give_up, gate_score=gate_scores(bundle.load_gate(), embs),
                    traces=[g[0] for g in traces(ts, [[i] for i in idx])],
                    truth=[ts.problems[i].answer for i in idx],
                    supervised=[ts.raw_labels(i, "supervised") for i in idx],
                    certified=[ts.labels(i, bundle.label_mode) for i in idx],
                    prompt=[prompt_of(ts.problems[i].id)[0] for i in idx])


def gate_scores(gate: ShiftGate, embs: Sequence[np.ndarray]) -> np.ndarray:
    """The gate's score of each trace's first `gate.steps` step embeddings ([n]; nan where the
    trace is too short to be gated), as the engine scores them (`ShiftGate.score`)."""
    import torch  # deferred: the report alone needs no torch

    out = np.full(len(embs), np.nan)
    feats = [gate_features(e, gate.steps) for e in embs]
    have = [i for i, f in enumerate(feats) if f is not None]
    if have:
        out[have] = gate.score(torch.from_numpy(np.stack([feats[i] for i in have]))).numpy()
    return out


def gate_flags(rep: Replayed, threshold: float) -> np.ndarray:
    """The gate's decision per request ([n] bool): score above the bundle's threshold at its
    alpha (a trace too short to be gated is never flagged: its gate never decides)."""
    with np.errstate(invalid="ignore"):
        return np.nan_to_num(rep.gate_score, nan=-np.inf) > threshold


def served_flagged(flags: np.ndarray, alarm: StreamAlarm | None = None) -> np.ndarray:
    """The requests served as flagged: the gate's own flags, and those a stream-level alarm
    (fed the gate's decisions in stream order) adds."""
    return flags if alarm is None else flags | np.asarray(alarm(flags), dtype=bool)


def served_ends(stop_scores: Sequence[np.ndarray], give_up_scores: Sequence[np.ndarray],
                lam: float, mu: float | None, flagged: np.ndarray, gate_steps: int,
                safe: float = NEVER, no_give_up: np.ndarray | None = None
                ) -> tuple[np.ndarray, list[Ended]]:
    """Where and how each request ends under (lambda, mu) with the gate: steps before the gate
    step (0-based gate_steps - 1) neither stop nor give up; a flagged request runs its safe
    threshold `safe` (`settings.contract.safe_lam`: NEVER, full reasoning, for the `full`
    action; the bundle's largest lambda* for `strict`) and never gives up; nor does one in
    `no_give_up` ([n] bool; above the give-up side's threshold, `--give-up-alpha`). `mu` None:
    one-sided. The scores: each request's smoothed stop and give-up scores ([T_i] each)."""
    held = [np.arange(len(s)) < gate_steps - 1 for s in stop_scores]
    stop = [np.where(h | f, -np.inf, s) for s, h, f in zip(stop_scores, held, flagged)]
    lengths = np.array([len(s) for s in stop])
    if mu is None:
        end = stop_indices(stop, np.array([lam]))[0]
        ended = [Ended.EARLY if e < n - 1 else Ended.FULL for e, n in zip(end, lengths)]
    else:
        blocked = flagged if no_give_up is None else flagged | no_give_up
        give_up = [np.where(h | f, np.inf, g)
                   for g, h, f in zip(give_up_scores, held, blocked)]
        end, ended = two_sided_ends(stop, give_up, lam, mu)
    if safe < NEVER and flagged.any():  # the flagged ones stop at the safe threshold instead
        rows = np.flatnonzero(flagged)
        strict = stop_indices([np.where(held[i], -np.inf, stop_scores[i]) for i in rows],
                              np.array([safe]))[0]
        end, ended = np.array(end).copy(), list(ended)
        for i, e in zip(rows, strict):
            end[i] = e
            ended[i] = Ended.EARLY if e < lengths[i] - 1 else Ended.FULL
    return end, ended


def rate(events: Sequence[bool]) -> dict[str, Any]:
    """k / n with its exact 95% interval."""
    k, n = int(np.sum(events)), len(events)
    return {"rate": k / n if n else math.nan, "k": k, "n": n,
            "ci95": list(interval95(k, n)) if n else None}


def tokens_of(rep: Replayed, end: np.ndarray, ended: Sequence[Ended]) -> np.ndarray:
    """Completion tokens per request ([n]): reasoning through its end step plus the trace's
    answer, or the whole trace where it ran to its end."""
    return np.array([float(tr.completion) if how == Ended.FULL
                     else float(tr.cum[e] + tr.answer_tokens)
                     for tr, e, how in zip(rep.traces, end, ended)])


def clustered_ci(num: np.ndarray, den: np.ndarray, clusters: Sequence[str], boots: int = 4000,
                 seed: int = 34) -> tuple[float, float]:
    """A 95% percentile interval for sum(num) / sum(den) from a bootstrap over clusters (the
    prompts: k samples of one prompt are not independent requests, so resampling them one by
    one gives intervals too narrow)."""
    ids = {c: j for j, c in enumerate(dict.fromkeys(clusters))}
    col = np.array([ids[c] for c in clusters])
    n_, d_ = (np.bincount(col, weights=x, minlength=len(ids)) for x in (num, den))  # [P] each
    draws = np.random.default_rng(seed).integers(0, len(ids), (boots, len(ids)))  # [B, P]
    ratio = n_[draws].sum(1) / d_[draws].sum(1)  # [B]
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return float(lo), float(hi)


def savings_lost(bundle: Bundle, rep: Replayed, action: ShiftAction = ShiftAction.FULL,
                 alpha: float | None = None) -> dict[str, Any]:
    """What the gate costs where the bundle was calibrated: per delta, the one-sided tokens
    with the gate (flagged requests served by `action`) minus without, in points of full
    reasoning's tokens, and the flag rate; intervals clustered by prompt."""
    gate = bundle.load_gate()
    alpha = gate.levels(alpha)[0]
    flags = gate_flags(rep, gate.thresholds(alpha)[0])
    none = np.zeros(len(rep), dtype=bool)
    prompts = rep.prompt or [str(i) for i in range(len(rep))]
    full = np.array([float(tr.completion) for tr in rep.traces])  # [n]
    out: dict[str, Any] = {"n": len(rep), "prompts": len(set(prompts)), "alpha": alpha,
                           "action": str(action), "full_tokens": float(full.mean()),
                           "flagged": float(flags.mean()),
                           "flagged_ci95": list(clustered_ci(flags.astype(float),
                                                             np.ones(len(rep)), prompts)),
                           "rows": []}
    for row in bundle.ltt.rows:
        lam = bundle.lam(row.delta)
        ungated = tokens_of(rep, *served_ends(rep.stop, rep.give_up, lam, None, none, gate.steps))
        gated = tokens_of(rep, *served_ends(rep.stop, rep.give_up, lam, None, flags, gate.steps,
                                            safe_lam(bundle, action)))
        lo, hi = clustered_ci(gated - ungated, full, prompts)
        out["rows"].append({"delta": row.delta, "tokens_ungated": float(ungated.mean()),
                            "tokens_gated": float(gated.mean()),
                            "lost_points": 100 * float((gated - ungated).sum() / full.sum()),
                            "lost_ci95": [100 * lo, 100 * hi]})
    return out


def savings_table(fig: dict[str, Any]) -> str:
    lo, hi = fig["flagged_ci95"]
    lines = [f"savings lost to the gate ({fig['action']}, alpha {fig['alpha']:g}; n = {fig['n']}, "
             f"{fig['prompts']} prompts; flagged {fig['flagged']:.3f} [{lo:.3f}, {hi:.3f}] "
             f"clustered by prompt; full reasoning {fig['full_tokens']:.0f} tokens)", "",
             "| delta | tokens, no gate -> gate | savings lost (points of full's tokens) [95%, by "
             "prompt] |", "| --- | --- | --- |"]
    lines += [f"| {r['delta']:g} | {r['tokens_ungated']:.0f} -> {r['tokens_gated']:.0f} | "
              f"{r['lost_points']:.1f} [{r['lost_ci95'][0]:.1f}, {r['lost_ci95'][1]:.1f}] |"
              for r in fig["rows"]]
    return "\n".join(lines)


def arm_figures(rep: Replayed, end: np.ndarray, ended: Sequence[Ended], flagged: np.ndarray,
                policy: GiveUpPolicy, excluded_never_correct: bool) -> dict[str, Any]:
    """Accuracy (the delivered answer: the probed one at an early stop or a give-up under
    "guess", the trace's own at its end), tokens (reasoning through the end step plus the
    trace's answer), stop errors (over the requests the certified risk counts: an early stop
    whose cumulative label there is 0) and the give-up error (every request)."""
    correct, sup_err, cert_err, gave_err = [], [], [], []
    for tr, y, sup, cert, e, how in zip(rep.traces, rep.truth, rep.supervised, rep.certified,
                                        end, ended):
        answer = tr.final if how == Ended.FULL else tr.step_answers[e]
        if how == Ended.GAVE_UP and policy == GiveUpPolicy.MESSAGE:
            answer = None
        correct.append(equivalent(answer, y))
        early = how == Ended.EARLY
        if not excluded_never_correct or sup.any():
            sup_err.append(early and cumulative(sup)[e] == 0)
        if not excluded_never_correct or cert.any():
            cert_err.append(early and cert[e] == 0)
        gave_err.append(how == Ended.GAVE_UP
                        and bool(lost_by_giving_up(e, last_right(sup), policy)))
    n = len(correct)
    return {"n": n, "accuracy": float(np.mean(correct)),
            "accuracy_ci95": list(wilson(int(np.sum(correct)), n)),
            "tokens": float(np.mean(tokens_of(rep, end, ended))),
            "stop_error": rate(sup_err), "stop_error_certified": rate(cert_err),
            "give_up_error": rate(gave_err),
            "ended_early": float(np.mean([h == Ended.EARLY for h in ended])),
            "gave_up": float(np.mean([h == Ended.GAVE_UP for h in ended])),
            "flagged": rate(list(flagged))}


def stream_alarm(n_cal: int, alpha: float, level: float, lag: np.ndarray) -> StreamAlarm:
    """The gate alarm (orca_method.gate_alarm, fresh at the stream's first request, fed in
    arrival order) as a stream alarm: request j is served as flagged when the alarm is raised
    once it has heard the requests before j - lag[j] (`alarm_lags`)."""
    def served(flags: np.ndarray) -> np.ndarray:
        alarm = GateAlarm(n_cal, alpha, level)
        hi, lo = 1.0 / (n_cal + 1), 1.0  # p-values the alarm reads as flagged / passed
        raised_after = [alarm.alarmed]  # [k]: raised once it has heard k decisions
        for f in flags:
            alarm.observe(hi if f else lo)
            raised_after.append(alarm.alarmed)
        return np.array([raised_after[max(0, j - int(lag[j]))] for j in range(len(flags))])
    return served


def alarm_lags(rep: Replayed, in_flight: int, gate_steps: int, at: str) -> np.ndarray:
    """How many requests before request j the alarm has not heard when it serves j ([n]), with
    `in_flight` requests running and a new one arriving as one ends. `at` "finish" (the
    server's alarm before issue 34's round 4): a decision is heard when its request finishes, so
    the `in_flight` before j are not. `at` "gate" (the engine core's, `orca_serve/core/
    gate_alarm.py`): a decision is heard at its request's gate step, so j is served knowing every
    request before it but those that arrived while j was reaching its gate step (in arrival
    order, a request not decided holds the later ones back): in_flight x (j's tokens to its gate
    step, + 1 for the readback) / (the family's mean completion tokens) arrivals, rounded up."""
    if at == "finish":
        return np.full(len(rep), in_flight)
    mean = float(np.mean([tr.completion for tr in rep.traces]))
    to_gate = np.array([float(tr.cum[min(gate_steps, len(tr.cum)) - 1]) + 1.0
                        for tr in rep.traces])
    return np.ceil(in_flight * to_gate / mean).astype(int)


def references(bundle: Bundle, rep: Replayed, reasoner: str = "long") -> dict[str, Any]:
    """What every ORCA arm on these traces is compared with: full reasoning (`full`) and the
    thinking budget at each of `reasoner`'s BUDGETS (`budget`), replayed from the same traces."""
    n = len(rep)
    full = arm_figures(rep, np.array([len(s) - 1 for s in rep.stop]), [Ended.FULL] * n,
                       np.zeros(n, dtype=bool), bundle.give_up.policy,
                       bundle.ltt.excluded_never_correct)
    budgets = []
    for b in BUDGETS[reasoner]:
        res = [budget_answer(tr, b) for tr in rep.traces]
        ok = [equivalent(a, y) for (a, _), y in zip(res, rep.truth)]
        budgets.append({"budget": b, "n": len(ok), "accuracy": float(np.mean(ok)),
                        "accuracy_ci95": list(wilson(int(np.sum(ok)), len(ok))),
                        "tokens": float(np.mean([t for _, t in res]))})
    return {"full": full, "budget": budgets}


def family_report(bundle: Bundle, rep: Replayed, alarm: StreamAlarm | None = None,
                  action: ShiftAction = ShiftAction.FULL, alpha: float | None = None,
                  reasoner: str = "long", give_up_alpha: float | None = None) -> dict[str, Any]:
    """Every arm on one family's replayed traces, flagged requests served by `action`, the
    gate at levels `alpha` and `give_up_alpha` (None: the bundle's, as the server's
    --orca-shift-alpha and --orca-shift-give-up-alpha; `ShiftGate.levels`), the thinking
    budgets of `reasoner`: the give-up side leaves alone every request above its level's
    threshold."""
    safe = safe_lam(bundle, action)
    gate = bundle.load_gate()
    alpha, give_up_alpha = gate.levels(alpha, give_up_alpha)
    thr, thr_give_up = gate.thresholds(alpha, give_up_alpha)
    flags = gate_flags(rep, thr)
    served = served_flagged(flags, alarm)
    none = np.zeros(len(rep), dtype=bool)
    no_give_up = gate_flags(rep, thr_give_up)
    policy, excl = bundle.give_up.policy, bundle.ltt.excluded_never_correct
    mu = bundle.mu(GIVE_UP_DELTA)
    out: dict[str, Any] = {
        "n": len(rep), "gate": {"alpha": alpha, "give_up_alpha": give_up_alpha,
                                "steps": gate.steps, "flagged": rate(list(flags)),
                                "barred": rate(list(no_give_up)),
                                "served_flagged": rate(list(served))},
        **references(bundle, rep, reasoner), "orca": []}
    for row in bundle.ltt.rows:
        lam = bundle.lam(row.delta)
        arms = {"one-sided": (None, served), "two-sided": (mu, served),
                "one-sided, no gate": (None, none)}
        point: dict[str, Any] = {"delta": row.delta, "lambda": lam}
        for name, (m, flagged) in arms.items():
            end, ended = served_ends(rep.stop, rep.give_up, lam, m, flagged, gate.steps, safe,
                                     no_give_up if flagged is served else None)
            fig = arm_figures(rep, end, ended, flagged, policy, excl)
            fig["versus_budget"] = against_budget(fig, out["budget"])
            point[name] = fig
        out["orca"].append(point)
    return out


def cell(r: dict[str, Any]) -> str:
    lo, hi = r["ci95"]
    return f"{r['k']}/{r['n']} = {r['rate']:.3f} [{lo:.3f}, {hi:.3f}]"


def acc(r: dict[str, Any]) -> str:
    lo, hi = r["accuracy_ci95"]
    return f"{r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}]"


def versus(v: dict[str, Any]) -> str:
    if "gap" not in v:
        return v["where"]
    lo, hi = v["gap_ci95"]
    return f"{v['gap']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def versus_orders(vs: list[dict[str, Any]]) -> str:
    """One arm against the thinking budget over arrival orders (`versus`, averaged)."""
    if any("gap" not in v for v in vs):
        return next(v["where"] for v in vs if "gap" not in v)
    gaps = [v["gap"] for v in vs]
    lo, hi = (np.mean([v["gap_ci95"][k] for v in vs]) for k in (0, 1))
    return f"{np.mean(gaps):+.3f} [{lo:+.3f}, {hi:+.3f}] ({min(gaps):+.3f})"


def table(family: str, rep: dict[str, Any]) -> str:
    """The family's markdown table and its done-means lines."""
    g = rep["gate"]
    lines = [f"**{family}** (n = {rep['n']}; gate alpha {g['alpha']:g} / give-up "
             f"{g['give_up_alpha']:g} on {g['steps']} steps "
             f"flags {cell(g['flagged'])}; full reasoning {rep['full']['tokens']:.0f} tokens, "
             f"accuracy {acc(rep['full'])})", "",
             "| delta | arm | stop error (supervised) | stop error (certified loss) | "
             "give-up error | accuracy | tokens | early / gave up | vs budget at its tokens |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in rep["orca"]:
        for name in ("one-sided", "two-sided", "one-sided, no gate"):
            r = p[name]
            lines.append(f"| {p['delta']:g} | {name} | {cell(r['stop_error'])} | "
                         f"{cell(r['stop_error_certified'])} | {cell(r['give_up_error'])} | "
                         f"{acc(r)} | {r['tokens']:.0f} | {r['ended_early']:.2f} / "
                         f"{r['gave_up']:.2f} | {versus(r['versus_budget'])} |")
    lines += ["", *budget_lines(rep), "", *done_means(rep)]
    return "\n".join(lines)


def budget_lines(rep: dict[str, Any]) -> list[str]:
    """The thinking budget's points (`references`) as a markdown table."""
    return ["| thinking budget B | accuracy | tokens |", "| --- | --- | --- |",
            *(f"| {b['budget']} | {acc(b)} | {b['tokens']:.0f} |" for b in rep["budget"])]


def done_means(rep: dict[str, Any]) -> list[str]:
    """Issue 34's done-means on this family, the defaults (gated) arms: one line each."""
    out = []
    for p in rep["orca"]:
        one, two = p["one-sided"], p["two-sided"]
        d = p["delta"]
        out.append(
            f"- delta {d:g}: stop error {one['stop_error']['rate']:.3f} <= delta: "
            f"{one['stop_error']['rate'] <= d} (95% upper {one['stop_error']['ci95'][1]:.3f}); "
            f"two-sided stop error {two['stop_error']['rate']:.3f} <= delta: "
            f"{two['stop_error']['rate'] <= d}; give-up error {two['give_up_error']['rate']:.3f} "
            f"<= {GIVE_UP_DELTA:g}: {two['give_up_error']['rate'] <= GIVE_UP_DELTA}; two-sided "
            f"accuracy >= one-sided - 0.02: {two['accuracy'] >= one['accuracy'] - 0.02}; "
            f"one-sided vs budget: {versus(one['versus_budget'])}")
    return out


def plot(family: str, rep: dict[str, Any], path: Path, reasoner: str = "long") -> None:
    import matplotlib  # deferred: only the report draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: only the report draws

    def bars(points: list[dict[str, Any]]) -> np.ndarray:
        a = np.array([p["accuracy"] for p in points])
        ci = np.array([p["accuracy_ci95"] for p in points])
        return np.stack([a - ci[:, 0], ci[:, 1] - a])

    fig, ax = plt.subplots(figsize=(6, 4.5))
    b = rep["budget"]
    ax.errorbar([x["tokens"] for x in b], [x["accuracy"] for x in b], yerr=bars(b), fmt="s--",
                color="grey", capsize=3, label="thinking budget (replayed)")
    for name, style in (("one-sided", "o-"), ("two-sided", "^-"), ("one-sided, no gate", "x:")):
        pts = [p[name] for p in rep["orca"]]
        ax.errorbar([x["tokens"] for x in pts], [x["accuracy"] for x in pts], yerr=bars(pts),
                    fmt=style, capsize=3, label=f"ORCA {name}")
        for p, x in zip(rep["orca"], pts):
            ax.annotate(f"{p['delta']:g}", (x["tokens"], x["accuracy"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    f = rep["full"]
    ax.errorbar([f["tokens"]], [f["accuracy"]], yerr=bars([f]), fmt="k*", markersize=10,
                label="full reasoning")
    ax.set(xlabel="completion tokens per request", ylabel="accuracy", ylim=(0, 1),
           title=f"{reasoner} reasoner, {family} (n = {rep['n']}), shipped bundle, replayed")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES),
                    help="collected families (in-dist: the savings the gate costs where the "
                         "bundle was calibrated)")
    ap.add_argument("--k", type=int, default=1,
                    help="the collection's samples per prompt; every sample is replayed as a "
                         "request of its own (k > 1: the intervals treat samples of one prompt "
                         "as independent, so they are too narrow)")
    ap.add_argument("--reasoner", choices=sorted(REASONERS), default="long")
    ap.add_argument("--bundle", type=Path, default=None,
                    help="default: the reasoner's shipped bundle")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--plots", type=Path, default=ROOT / "benchmarks",
                    help="where replay-shift-REASONER-FAMILY.png go")
    ap.add_argument("--gate-alarm", type=float, default=0.0, metavar="LEVEL",
                    help="replay with the server's gate alarm at this level (0: none), fresh "
                         "at the family's first request, over --orders random arrival orders")
    ap.add_argument("--in-flight", type=int, default=0,
                    help="requests running while a request arrives (`alarm_lags`)")
    ap.add_argument("--alarm-at", choices=("gate", "finish"), default="gate",
                    help="when the alarm hears a request's decision: at its gate step (the "
                         "engine core's alarm, the default) or when it finishes (the server's "
                         "alarm before it moved into the engine)")
    ap.add_argument("--orders", type=int, default=20)
    ap.add_argument("--shift-action", choices=[str(ShiftAction.FULL), str(ShiftAction.STRICT)],
                    default=str(DEFAULTS.shift_action), help="how a flagged request is served "
                    "(the server's --orca-shift-action, and its default)")
    ap.add_argument("--give-up-alpha", type=float, default=None,
                    help="the give-up side's gate level (the server's "
                         "--orca-shift-give-up-alpha; default: the bundle's)")
    ap.add_argument("--trajectories", type=Path, default=None,
                    help="replay this trajectory set (e.g. a calibration job's own) as the one "
                         "family --families names, instead of its bench_samples collection")
    ap.add_argument("--shift-alpha", type=float, default=None,
                    help="the gate's level (the server's --orca-shift-alpha; default: the "
                         "bundle's)")
    a = ap.parse_args(argv)
    if a.trajectories is not None and len(a.families) != 1:
        ap.error("--trajectories replays one family: name it with --families")
    bundle = load_bundle(a.bundle or ROOT / REASONERS[a.reasoner][1])
    a.out.mkdir(parents=True, exist_ok=True)
    for family in a.families:
        ts = TrajectorySet.open(a.trajectories or run_dir(a.reasoner, a.k, family) / "trajectories")
        rep = replay_family(bundle, ts)
        if a.gate_alarm:
            alarmed(bundle, rep, family, a)
            continue
        action = ShiftAction(a.shift_action)
        if family == "in-dist":
            lost = savings_lost(bundle, rep, action, a.shift_alpha)
            (a.out / f"{a.reasoner}-savings-{action}.json").write_text(json.dumps(lost, indent=1))
            print(savings_table(lost), "\n", flush=True)
        fig = family_report(bundle, rep, action=action, alpha=a.shift_alpha, reasoner=a.reasoner,
                            give_up_alpha=a.give_up_alpha)
        (a.out / f"{family}.json").write_text(json.dumps(fig, indent=1))
        plot(family, fig, a.plots / f"replay-shift-{a.reasoner}-{family}.png", a.reasoner)
        print(table(family, fig), "\n", flush=True)


def alarmed(bundle: Bundle, rep: Replayed, family: str, a: argparse.Namespace) -> None:
    """The defaults plus the gate alarm, over random arrival orders of the family's requests:
    per delta the gated arms' stop and give-up errors (mean and worst order), and the requests
    served a bad lambda (stopped or gave up wrongly) before the alarm acted."""
    gate = bundle.load_gate()
    alpha = gate.levels(a.shift_alpha)[0]
    rng = np.random.default_rng(34)
    runs = []
    for _ in range(a.orders):
        sub = rep.subset(rng.permutation(len(rep)))
        alarm = stream_alarm(len(gate.scores), alpha, a.gate_alarm,
                             alarm_lags(sub, a.in_flight, gate.steps, a.alarm_at))
        runs.append(family_report(bundle, sub, alarm, ShiftAction(a.shift_action), alpha,
                                  a.reasoner, a.give_up_alpha))
    tag = "" if a.alarm_at == "gate" else "-at-finish"
    path = a.out / f"{family}-alarm{a.gate_alarm:g}-inflight{a.in_flight}{tag}.json"
    path.write_text(json.dumps(runs, indent=1))
    served = [r["gate"]["served_flagged"]["rate"] for r in runs]
    print(f"**{family}**, gate alarm level {a.gate_alarm:g} heard at each request's "
          f"{a.alarm_at}, {a.in_flight} in flight, "
          f"{a.orders} arrival orders (n = {rep.__len__()}): served as flagged "
          f"{np.mean(served):.3f} (gate alone {runs[0]['gate']['flagged']['rate']:.3f})\n")
    print("| delta | stop error, mean (worst order) [mean 95% upper] | give-up error, mean "
          "(worst) | two-sided minus one-sided accuracy, mean (worst) | one-sided accuracy | "
          "tokens | vs thinking budget at its tokens, mean gap [mean 95% bounds] (worst) | "
          "orders where each holds: stop <= delta / give-up <= "
          f"{GIVE_UP_DELTA:g} / accuracy within 2 points |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, row in enumerate(runs[0]["orca"]):
        one = [r["orca"][i]["one-sided"] for r in runs]
        two = [r["orca"][i]["two-sided"] for r in runs]
        se = [o["stop_error"]["rate"] for o in one]
        ge = [t["give_up_error"]["rate"] for t in two]
        gap = [t["accuracy"] - o["accuracy"] for o, t in zip(one, two)]
        print(f"| {row['delta']:g} | {np.mean(se):.3f} ({max(se):.3f}) "
              f"[{np.mean([o['stop_error']['ci95'][1] for o in one]):.3f}] | {np.mean(ge):.3f} "
              f"({max(ge):.3f}) | {np.mean(gap):+.3f} ({min(gap):+.3f}) | "
              f"{np.mean([o['accuracy'] for o in one]):.3f} | "
              f"{np.mean([o['tokens'] for o in one]):.0f} | "
              f"{versus_orders([o['versus_budget'] for o in one])} | "
              f"{np.mean(np.array(se) <= row['delta']):.2f} / "
              f"{np.mean(np.array(ge) <= GIVE_UP_DELTA):.2f} / "
              f"{np.mean(np.array(gap) >= -0.02 - 1e-9):.2f} |")
    print(flush=True)


if __name__ == "__main__":
    main()
