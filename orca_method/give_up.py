"""Giving up: the lower threshold mu* and its risk (docs/METHOD.md section 9).

ORCA's upper threshold lambda* ends a trace once its answer is probably right. The lower one ends
a trace once it will probably not get right: a second score ``g_t`` (the give-up probe's smoothed
estimate that a right answer still lies ahead) is compared with mu*, and the request gives up at
the first step with ``g_t <= mu*``. Giving up at the last step is not giving up (the trace ends
there anyway; online, the last step is closed by the end tag and never scored).

The give-up loss of one trace under mu is ``1{it gives up at a step tau_g} * 1{some step at or
after tau_g is right}`` under the raw (per-step) reference labels: giving up threw away a right
answer that continuing could still reach. Whatever lambda ends the trace otherwise, its answer
comes from a step at or after tau_g (or the give-up pre-empted nothing), so a request that the
pair (lambda, mu) answers wrong and lambda alone answers right has loss 1: the loss bounds the
accuracy the give-up costs the deployed pair for every lambda at once, and mu* certified for it
holds whatever delta a request picks, with its own epsilon on the same calibration set (the
joint statement, by the union bound: docs/METHOD.md section 9). A right answer only before
tau_g costs nothing here: no continuation from tau_g returns to it.

What the loss must count depends on what a given-up request serves (`--orca-give-up-policy`,
docs/METHOD.md section 9 "The guarantee per give-up policy"). Under "guess" it still answers,
with its answer at tau_g, and the loss above bounds what it costs both under raw labels and
under the stop risk's own cumulative accounting (a trace counts as right at every step from
its first right one on). Under "message" it answers nothing: by the cumulative accounting
every give-up on a trace that is ever right is a request lost, though continuing would not
have returned to a right answer, so its loss is ``1{it gives up} * 1{some step is right}``
(the pre-2026-11-26 loss); a mu* certified for "guess" does not hold for it.

LTT over mu: the grid runs from 0.0 (conservative: give up only on a score of 0) up to 1.0;
``H_j: risk(mu_j) >= delta_2`` gets the exact binomial p-value and fixed-sequence testing keeps
the last rejected mu (`orca_method.ltt`, the same tests as lambda*).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orca_method.ltt import DEFAULT_EPSILON, n_rejected, pvalue_fn
from orca_method.risk import Ragged, stop_indices, values_at
from orca_method.outcomes import GIVE_UP_POLICIES, Ended, GiveUpPolicy, PValue
from orca_method.thresholds import GIVE_UP_NEVER


def mu_grid(m: int = 1001) -> np.ndarray:
    """``m`` evenly spaced give-up thresholds from 0.0 (conservative) up to 1.0, fixed in
    advance (a grid built from the scores would make the hypotheses data-dependent)."""
    if m < 1:
        raise ValueError(f"grid size must be >= 1, got {m}")
    return np.linspace(0.0, 1.0, m)


def give_up_indices(scores: Ragged, mus: np.ndarray) -> np.ndarray:
    """0-based ``tau_g[j, i] = min{t : g_it <= mu_j}``, ``T_i - 1`` when it never gives up
    before the last step. Exact: ``g <= mu`` is ``-g >= -mu`` (negation rounds nothing), so
    the stop rule's binary search (`orca_method.risk.stop_indices`) serves both sides."""
    return stop_indices([-np.asarray(g, dtype=float) for g in scores],
                        -np.asarray(mus, dtype=float))


def gave_up(tau_g: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Whether each trace gave up (bool, shape of ``tau_g``): before its last step."""
    return tau_g < np.asarray(lengths) - 1


def last_right(labels: Sequence[int]) -> int:
    """The last step whose answer is right under raw (per-step, not cumulative) labels, -1 when
    none is: giving up at or before it throws away a right answer still to come."""
    right = np.flatnonzero(np.asarray(labels))
    return int(right[-1]) if right.size else -1


def right_ahead(labels: Sequence[int]) -> np.ndarray:
    """Per step (int8, the labels' length): 1 while a right answer lies at this step or later
    under raw labels. What the give-up probe estimates (`orca_calibrate.train.train_give_up`)."""
    raw = np.asarray(labels, dtype=np.int8)
    return np.maximum.accumulate(raw[::-1])[::-1].copy()


def lost_by_giving_up(step: np.ndarray, last: np.ndarray, policy: GiveUpPolicy) -> np.ndarray:
    """Whether giving up at ``step`` is a loss under ``policy`` (module docstring), per trace
    (broadcast); ``last``: each trace's last right step (`last_right`, -1: never right).
    "guess": ``step`` is at or before ``last``, so a right answer lay ahead; "message": the
    trace is right at some step. The one rule of calibration and of every offline measure."""
    if policy not in GIVE_UP_POLICIES:
        raise ValueError(f"give-up policy must be one of {GIVE_UP_POLICIES}, got {policy!r}")
    last = np.asarray(last)
    return last >= 0 if policy == GiveUpPolicy.MESSAGE else np.asarray(step) <= last


def give_up_losses(tau_g: np.ndarray, lengths: np.ndarray, last: np.ndarray,
                   policy: GiveUpPolicy = GiveUpPolicy.GUESS) -> np.ndarray:
    """0/1 loss (int8, shape of ``tau_g`` [mus, traces]) of a give-up under ``policy``: it gave
    up, and that lost (`lost_by_giving_up`)."""
    return (gave_up(tau_g, lengths) & lost_by_giving_up(tau_g, last, policy)).astype(np.int8)


def changed_by_giving_up(agrees: np.ndarray, policy: GiveUpPolicy) -> np.ndarray:
    """Whether giving up changed what the request serves from what reasoning to the end serves,
    per trace (broadcast): the give-up loss under consistency labels (docs/METHOD.md section 9,
    "Giving up under consistency labels"). ``agrees``: the raw consistency label at the give-up
    step (its answer is the final one). "guess" serves that answer: changed when it is not the
    final one; "message" serves none: always changed."""
    if policy not in GIVE_UP_POLICIES:
        raise ValueError(f"give-up policy must be one of {GIVE_UP_POLICIES}, got {policy!r}")
    agrees = np.asarray(agrees)
    return np.ones(agrees.shape, bool) if policy == GiveUpPolicy.MESSAGE else agrees == 0


def consistency_give_up_losses(tau_g: np.ndarray, labels: Ragged,
                               policy: GiveUpPolicy = GiveUpPolicy.GUESS) -> np.ndarray:
    """0/1 loss (int8, shape of ``tau_g`` [mus, traces]) under consistency labels: it gave up,
    and that changed the answer (`changed_by_giving_up`); ``labels``: each trace's raw
    consistency labels (1 where the step's answer is the trace's final answer)."""
    lengths = np.array([len(y) for y in labels])
    agrees = values_at([np.asarray(y, dtype=np.int8) for y in labels], tau_g)
    return (gave_up(tau_g, lengths) & changed_by_giving_up(agrees, policy)).astype(np.int8)


def request_consistency_give_up_loss(scores: Sequence[float], mu: float, labels: Sequence[int],
                                     policy: GiveUpPolicy = GiveUpPolicy.GUESS) -> int:
    """One audit's give-up loss under consistency labels at ``mu`` (what a mu recalibrated on
    live audits is certified for and audited with)."""
    tau = give_up_indices([np.asarray(scores, dtype=float)], np.array([mu], dtype=float))
    return int(consistency_give_up_losses(tau, [labels], policy)[0, 0])


def request_give_up_loss(scores: np.ndarray, mu: float, labels: Sequence[int] | None,
                         policy: GiveUpPolicy = GiveUpPolicy.GUESS) -> int:
    """One trace's give-up loss under ``mu`` and ``policy`` (`give_up_losses` for one trace), as
    the live audit and `orca-calibrate audit-report` measure it; ``labels``: its raw reference
    labels.

    ``labels`` None: they cannot tell. Live audits label by consistency only, and under
    consistency the last step always agrees with the final answer, so a right answer counts as
    lying ahead at every step and the loss is whether it gave up: at least the certified loss,
    whatever the trace's true labels (docs/AUDIT.md, "The give-up risk").
    """
    g = np.asarray(scores, dtype=float)
    tau = give_up_indices([g], np.array([mu], dtype=float))
    last = np.array([g.size - 1 if labels is None else last_right(labels)])
    return int(give_up_losses(tau, np.array([g.size]), last, policy)[0, 0])


@dataclass(frozen=True)
class GiveUpResult:
    """LTT outcome for one give-up risk level, with calibration-set facts at mu*.

    ``mu`` is GIVE_UP_NEVER when no threshold is certified (never give up); then ``pvalue``
    is 1.0, as for lambda* (`orca_method.ltt.DeltaResult`).
    """

    delta: float
    mu: float
    risk: float  # P(gave up with a right answer ahead) on the calibration set
    pvalue: float
    give_up_rate: float  # share of calibration traces that gave up
    n: int


def check_give_up_set(scores: Ragged, last: Sequence[int]) -> None:
    """Raise ValueError on inputs that would silently give wrong give-up steps or losses."""
    if len(scores) == 0:
        raise ValueError("no traces: the calibration set is empty")
    if len(last) != len(scores):
        raise ValueError(f"{len(scores)} score arrays but {len(last)} last right steps")
    for i, (g, k) in enumerate(zip(scores, last)):
        g = np.asarray(g)
        if g.ndim != 1 or g.size == 0:
            raise ValueError(f"trace {i}: scores must be a non-empty 1-D array")
        if not np.all((g >= 0.0) & (g <= 1.0)):
            raise ValueError(f"trace {i}: scores must be finite and in [0, 1]")
        if not -1 <= k < g.size:
            raise ValueError(f"trace {i}: last right step {k} is outside its {g.size} steps "
                             "(-1: never right)")


def calibrate_give_up(scores: Ragged, last: Sequence[int], deltas: Sequence[float],
                      epsilon: float = DEFAULT_EPSILON, grid: np.ndarray | None = None,
                      pvalue: PValue = PValue.BINOMIAL, policy: GiveUpPolicy = GiveUpPolicy.GUESS,
                      consistency: Ragged | None = None) -> list[GiveUpResult]:
    """mu* for each give-up risk level ``delta`` at level ``epsilon``, certified for what a
    given-up request serves under ``policy`` (`give_up_losses`).

    ``scores``: smoothed give-up scores of EVERY calibration trace (the risk is over all
    requests: never-right traces count, with loss 0); ``last``: each trace's last right step
    under raw reference labels (`last_right`, -1 when never right). ``consistency``: the
    traces' raw consistency labels instead (``last`` unused): certifies the loss under
    consistency labels (`consistency_give_up_losses`), as a live recalibration does.
    """
    if consistency is not None:
        if len(consistency) != len(scores) or any(
                len(y) != len(g) for y, g in zip(consistency, scores)):
            raise ValueError("need one consistency label per give-up score of every trace")
        last = [len(g) - 1 for g in scores]
    check_give_up_set(scores, last)
    for name, v in [("epsilon", epsilon)] + [("delta_2", d) for d in deltas]:
        if not 0.0 < v < 1.0:
            raise ValueError(f"{name} must be in (0, 1), got {v}")
    grid = mu_grid() if grid is None else np.asarray(grid, dtype=float)
    if grid.ndim != 1 or grid.size == 0 or not np.all(np.isfinite(grid)):
        raise ValueError("grid must be a non-empty 1-D array of finite thresholds")
    if np.any(np.diff(grid) <= 0):
        raise ValueError("grid must be strictly increasing (conservative to aggressive)")
    pvalues = pvalue_fn(pvalue)
    n = len(scores)
    lengths = np.array([len(g) for g in scores])
    tau = give_up_indices(scores, grid)
    loss = (give_up_losses(tau, lengths, np.asarray(last), policy) if consistency is None
            else consistency_give_up_losses(tau, consistency, policy))
    counts = loss.sum(axis=1, dtype=np.int64)
    rates = gave_up(tau, lengths).mean(axis=1)
    out = []
    for delta in deltas:
        p = pvalues(counts, n, float(delta))
        last = n_rejected(p, epsilon) - 1
        if last < 0:
            out.append(GiveUpResult(float(delta), GIVE_UP_NEVER, 0.0, 1.0, 0.0, n))
        else:
            out.append(GiveUpResult(float(delta), float(grid[last]), float(counts[last] / n),
                                    float(p[last]), float(rates[last]), n))
    return out


def two_sided_ends(stop_scores: Ragged, give_up_scores: Ragged, lam: float,
                   mu: float) -> tuple[np.ndarray, list[Ended]]:
    """Where and how the deployed pair (lambda, mu) ends each trace: 0-based end step and
    `orca_method.outcomes` name per trace. The stop wins a tie (both fire at one step: the
    answer is probably right, so it is given); the server decides the same way
    (orca_method.procedure)."""
    if len(stop_scores) != len(give_up_scores):
        raise ValueError(f"{len(stop_scores)} stop score arrays but {len(give_up_scores)} "
                         "give-up score arrays")
    for i, (m, g) in enumerate(zip(stop_scores, give_up_scores)):
        if len(m) != len(g):
            raise ValueError(f"trace {i}: {len(m)} stop scores but {len(g)} give-up scores")
    lengths = np.array([len(m) for m in stop_scores])
    tau_u = stop_indices(stop_scores, np.array([lam]))[0]
    tau_g = give_up_indices(give_up_scores, np.array([mu]))[0]
    ends: list[Ended] = []
    for u, g, t in zip(tau_u, tau_g, lengths):
        ends.append(Ended.GAVE_UP if g < u else Ended.EARLY if u < t - 1 else Ended.FULL)
    return np.minimum(tau_u, tau_g), ends


def tokens_used(step_tokens: Ragged, end: np.ndarray) -> np.ndarray:
    """Reasoning tokens spent up to and including each trace's end step."""
    return values_at([np.cumsum(k) for k in step_tokens], np.asarray(end))
