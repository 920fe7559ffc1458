"""Simulated audit streams through the server's own classes (tests/test_audit_stats.py and
benchmarks/bench_audit_stats.py share them): the alarm's false alarms and delays on Bernoulli
losses, and what `--orca-on-alarm recalibrate` serves after a shift.

Trajectories of T = 10 steps: the answer is right from a uniform step F on (cumulative labels
1{t >= F}, every trajectory solvable), scores sigmoid(1.2 (t - F) + bias + N(0, 1)). A bundle
calibrated by LTT on 1,000 unshifted ones (bias 0) has, at delta 0.1, lambda* 0.533 and risk
0.086; at bias 1.5 (the shift: scores high too early) the same lambda has risk 0.566, the
shift the review measured on the demo (0.092 -> 0.561). True risks are Monte Carlo means over
100,000 fresh trajectories (standard error <= 0.0016).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from unittest import mock

import numpy as np

from orca_method.audit.sequence import DEFAULT_GRID, RESTART_EVERY, RestartedAlarm
from orca_method.ltt import calibrate, default_grid
from orca_method.probe import Probe, ProbeSpec
from orca_method.risk import losses, stop_indices
from orca_method.answer_probes import ProbeSettings
from orca_method.thresholds import NEVER
from orca_serve.live_audit.labeller import AuditLabeller
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig
from tests.bundles import tiny_bundle


def hardest_null(epsilon: float, *, streams: int, audits: int, every: int = RESTART_EVERY,
                 grid: int = DEFAULT_GRID, seed: int = 0, delta: float = 0.1) -> float:
    """Share of streams in which the alarm ever fires when every audit's risk is exactly
    delta (a grid point): the hardest null, where a false alarm is likeliest."""
    rng = np.random.default_rng(seed)
    fam = RestartedAlarm(epsilon, every=every, grid_size=grid, shape=(streams,))
    ever = np.zeros(streams, bool)
    for _ in range(audits):
        fam.update((rng.random(streams) < delta).astype(float))
        ever |= fam.alarm(delta)
    return float(ever.mean())


def shift_delays(epsilon: float, clean: int, before: float, after: list[float], *,
                 streams: int, seed: int = 0, grid: int = DEFAULT_GRID, limit: int = 3000,
                 delta: float = 0.1) -> dict[float, tuple[np.ndarray, np.ndarray]]:
    """Per shifted risk: audits from the shift until the alarm, after `clean` audits at risk
    `before` (one clean history, shared by the shifts), of the alarm and of its member 0
    alone (the whole history: the alarm before restarts); inf when not within `limit`."""
    rng = np.random.default_rng(seed)
    start = RestartedAlarm(epsilon, grid_size=grid, shape=(streams,))
    for _ in range(clean):
        start.update((rng.random(streams) < before).astype(float))
    out = {}
    for risk in after:
        fam = copy.deepcopy(start)
        when = {"family": np.full(streams, np.inf), "whole": np.full(streams, np.inf)}
        whole = fam.members[0][1]
        for i in range(1, limit + 1):
            x = (rng.random(streams) < risk).astype(float)
            if np.isinf(when["family"]).any():
                fam.update(x)  # member 0 included
                when["family"][np.isinf(when["family"]) & fam.alarm(delta)] = i
            else:
                whole.update(x)  # the family is done: member 0 alone, at a fraction of the cost
            when["whole"][np.isinf(when["whole"]) & whole.alarm(delta)] = i
            if np.isfinite(when["whole"]).all():
                break
        out[risk] = (when["family"], when["whole"])
    return out


STEPS = 10
SHIFT = 1.5  # the shifted family's score bias
DELTA, EPSILON = 0.1, 0.05


def trajectories(rng: np.random.Generator, n: int, bias: float) -> tuple[np.ndarray, np.ndarray]:
    """Scores [n, T] and cumulative labels [n, T] (int8)."""
    first = rng.integers(0, STEPS, n)  # [n]
    t = np.arange(STEPS)
    z = 1.2 * (t[None] - first[:, None]) + bias + rng.normal(0, 1, (n, STEPS))  # [n, T]
    return 1 / (1 + np.exp(-z)), (t[None] >= first[:, None]).astype(np.int8)


@lru_cache(maxsize=4)
def _truth(bias: float) -> tuple[np.ndarray, np.ndarray]:
    return trajectories(np.random.default_rng(12345), 100_000, bias)


def true_risk(lams: list[float], bias: float) -> np.ndarray:
    """risk(lambda) of the family with this bias, per lambda (inf: never stops early)."""
    s, c = _truth(bias)
    out = np.zeros(len(lams))
    for lo in range(0, len(s), 20_000):  # [n_lams, chunk] int8 at a time
        out += losses(stop_indices(list(s[lo:lo + 20_000]), np.asarray(lams)),
                      list(c[lo:lo + 20_000])).sum(axis=1)
    return out / len(s)


@lru_cache(maxsize=1)
def bundle():
    """The deployed bundle: LTT (grid 1001, binomial) on 1,000 unshifted trajectories, with
    consistency labels (the audits' own, so the guard acts on its alarm)."""
    s, c = trajectories(np.random.default_rng(0), 1000, 0.0)
    (res,) = calibrate(list(s), list(c), [DELTA], epsilon=EPSILON, grid=default_grid(1001))
    b = tiny_bundle(Probe(ProbeSpec(dim=8), seed=0), [(DELTA, res.lam)], epsilon=EPSILON,
                    label_mode="consistent")  # what audits label: the guard acts on it
    return b.model_copy(update={"ltt": b.ltt.model_copy(update={"grid_size": 1001})})


@dataclass
class Stream:
    alarm_at: int | None = None  # post-shift audits until the bundle's alarm
    served: list[tuple[float, float]] = field(default_factory=list)  # (lambda, bias) per audit
    recalibrations: int = 0


def recalibrate_stream(seed: int, *, clean: int = 50, shifted: int = 600,
                       window: int = 200) -> Stream:
    """`clean` unshifted audits, then `shifted` shifted ones, every one through LiveAudit
    (policy recalibrate, the server's RestartedAlarm and LTT); which lambda the guard serves
    after each audit, and under which family."""
    audit = LiveAudit(bundle(), AuditConfig(rate=1.0, on_alarm="recalibrate", window=window))
    g = audit.state.guard(DELTA)
    rng = np.random.default_rng(seed)
    out = Stream()
    for bias, n in ((0.0, clean), (SHIFT, shifted)):
        s, c = trajectories(rng, n, bias)
        for i in range(n):
            audit.see(list(s[i][:-1]), NEVER)  # every request's scores reach the drift tests
            audit.observe(list(s[i]), list(c[i]))
            if out.alarm_at is None and bias and g.engaged:
                out.alarm_at = i + 1
            if g.source == "audit":
                out.served.append((g.lam, bias))
    out.recalibrations = g.recalibrations
    return out


def bad_lambda_served(streams: list[Stream]) -> np.ndarray:
    """Per stream: did the guard ever serve a recalibrated lambda whose true risk, on the
    family it was served to, exceeds delta?"""
    pairs = sorted({p for st in streams for p in st.served})
    risk = {}
    for bias in {b for _, b in pairs}:
        lams = [lam for lam, b in pairs if b == bias]
        risk.update(zip(((lam, bias) for lam in lams), true_risk(lams, bias)))
    return np.array([any(risk[p] > DELTA for p in set(st.served)) for st in streams])


def cut_probabilities(risk: float, share: float, ratio: float) -> tuple[float, float]:
    """P(cut | loss 0), P(cut | loss 1) when `share` of all audits are cut and an audit with
    loss 1 is cut `ratio` times as often as one with loss 0 (hard problems run long)."""
    p0 = share / (ratio * risk + (1 - risk))
    return p0, ratio * p0


def censored_streams(risk: float, *, share: float, ratio: float, streams: int, audits: int,
                     seed: int, delta: float = DELTA, epsilon: float = EPSILON,
                     grid: int = DEFAULT_GRID) -> dict[str, np.ndarray]:
    """Bernoulli(risk) losses of the whole traffic, of which a loss-dependent share is cut
    (censored), through the server's CensoredAlarm, batched over streams. Per stream: whether
    [lower, upper] ever missed the whole traffic's risk (checked after every audit), the audit
    of the first alarm at `delta` (inf: none), and the final interval and risk range."""
    from orca_method.audit.sequence import CensoredAlarm

    p0, p1 = cut_probabilities(risk, share, ratio)
    rng = np.random.default_rng(seed)
    alarm = CensoredAlarm(epsilon, grid_size=grid, shape=(streams,))
    missed = np.zeros(streams, bool)
    first = np.full(streams, np.inf)
    for i in range(1, audits + 1):
        loss = rng.random(streams) < risk
        cut = rng.random(streams) < np.where(loss, p1, p0)
        alarm.update(loss.astype(float), cut)
        missed |= (alarm.lower > risk) | (alarm.upper < risk)
        first[np.isinf(first) & alarm.alarm(delta)] = i
    lo, hi = alarm.risk_range
    return {"missed": missed, "first_alarm": first, "lower": alarm.lower, "upper": alarm.upper,
            "range_low": lo, "range_high": hi, "censored": alarm.censored / audits}


DEMO_DELTAS = (0.05, 0.1, 0.15, 0.2)  # the demo bundle's table


def joint_null(split: str, *, streams: int, audits: int, seed: int, every: int = RESTART_EVERY,
               grid: int = DEFAULT_GRID, deltas: tuple[float, ...] = DEMO_DELTAS,
               epsilon: float = EPSILON) -> tuple[float, np.ndarray]:
    """Every delta of the table at its hardest null (each audit's loss at delta d is Bernoulli
    exactly d, independent across deltas: the union of false alarms is then largest), through
    the server's guards (CensoredAlarm at `guard_epsilon`), batched [streams, deltas]. Returns
    the share of streams in which ANY delta ever alarmed, and the per-delta shares."""
    from orca_method.audit.sequence import CensoredAlarm
    from orca_serve.live_audit.options import guard_epsilon

    d = np.asarray(deltas)
    rng = np.random.default_rng(seed)
    alarm = CensoredAlarm(guard_epsilon(epsilon, len(d), split), every=every, grid_size=grid,
                          shape=(streams, len(d)))
    ever = np.zeros((streams, len(d)), bool)
    for _ in range(audits):
        alarm.update((rng.random((streams, len(d))) < d).astype(float))
        ever |= alarm.alarm(d)
    return float(ever.any(axis=1).mean()), ever.mean(axis=0)


def known_loss(loss: bool) -> tuple[list[float], list[int]]:
    """Scores and labels of an audit whose loss is `loss` at every finite lambda (it stops at
    its first step, right there or not) and 0 when it never stops early."""
    return [1.0, 1.0], ([0, 1] if loss else [1, 1])


@dataclass
class Restarted:
    trace: list[tuple] = field(default_factory=list)  # per audit: (lower, upper, alarm, lam)
    ever_alarm: bool = False
    bundle_lambda_served: int = 0  # audits of the shifted stretch served the bundle's lambda*


def restarted_stream(seed: int, *, risks: list[float], restart_every: int | None,
                     journal_dir=None, on_alarm: str = "fallback", window: int = 200,
                     epsilon_split: str = "per-delta") -> Restarted:
    """Audits with Bernoulli(risks[i]) losses through the server's LiveAudit, the process
    "restarted" (a new LiveAudit) every `restart_every` audits: with `journal_dir`, each new
    one attaches the bundle's journal there (what the server does now); without, it starts
    empty (what every start did before). Counts the audits after the first one at a risk above
    delta that were served the bundle's lambda* (the alarmed one)."""
    from orca_serve.live_audit.journal import Journal, journal_path

    b = bundle()
    config = AuditConfig(rate=1.0, on_alarm=on_alarm, window=window,
                         epsilon_split=epsilon_split)
    rng = np.random.default_rng(seed)
    out = Restarted()
    audit = None
    shifted = False
    for i, risk in enumerate(risks):
        if audit is None or (restart_every and i % restart_every == 0):
            if audit is not None and audit.state.journal is not None:
                audit.state.journal.close()
            audit = LiveAudit(b, config, journal=None if journal_dir is None else Journal(
                journal_path(journal_dir, b.checksum), b.checksum, fsync=False))
        g = audit.state.guard(DELTA)
        shifted = shifted or risk > DELTA
        if shifted and g.source == "bundle":
            out.bundle_lambda_served += 1  # what a request admitted now is served
        audit.observe(*known_loss(bool(rng.random() < risk)))
        out.ever_alarm |= bool(g.alarm)
        out.trace.append((g.cs.lower, g.cs.upper, g.alarm, g.lam))
    if audit is not None and audit.state.journal is not None:
        audit.state.journal.close()
    return out


@lru_cache(maxsize=64)
def _drift_truth(bias: float) -> tuple[np.ndarray, np.ndarray]:
    """20,000 fresh trajectories at this bias (standard error of a risk near 0.1: 0.002)."""
    return trajectories(np.random.default_rng(54321), 20_000, bias)


@lru_cache(maxsize=4096)
def _risk_at(lam: float, bias: float) -> float:
    s, c = _drift_truth(bias)
    return float(losses(stop_indices(list(s), np.asarray([lam])), list(c)).mean())


def drift_stream(seed: int, *, clean: int = 50, drifting: int = 2000, final_bias: float = 3.0,
                 window: int = 200, distrust: bool = True, sequential: bool = True,
                 recent_half: bool = True) -> dict[str, int]:
    """`recalibrate` under a gradual drift: `clean` unshifted audits, then `drifting` audits
    whose score bias grows linearly from 0 to `final_bias`, every request audited and its
    scores fed to the drift tests (as LiveAudit.finished does). Counts the audits that were
    served a recalibrated lambda whose true risk on the current traffic (bias rounded to 0.1)
    exceeds delta, and the audits served the fallback. `distrust=False`: without the
    recalibrated lambda's drift tests; `sequential=False`: without its sequential one (what the
    server did before issue 34); `recent_half=False`: recalibrating on the whole window alone
    (before `window_lambda` took the larger lambda of the window and its recent half)."""
    if not recent_half:
        with mock.patch("orca_method.audit.guards.window_lambda",
                        lambda s, labels, d, eps, ltt: ltt(s, labels, d, eps)):
            return drift_stream(seed, clean=clean, drifting=drifting, final_bias=final_bias,
                                window=window, distrust=distrust, sequential=sequential)
    audit = LiveAudit(bundle(), AuditConfig(rate=1.0, on_alarm="recalibrate", window=window))
    g = audit.state.guard(DELTA)
    tests = g._window_drift
    if not distrust or not sequential:
        g._window_drift = lambda scores: (  # type: ignore[method-assign]
            tests(scores)[0] if distrust else None, None)
    rng = np.random.default_rng(seed)
    out = {"bad": 0, "fallback": 0, "recalibrations": 0}
    biases = [0.0] * clean + list(np.linspace(0, final_bias, drifting))
    for bias in biases:
        s, c = trajectories(rng, 1, bias)
        current = round(bias, 1)
        if g.source == "audit" and _risk_at(round(g.lam, 6), current) > DELTA:
            out["bad"] += 1
        out["fallback"] += g.source == "fallback"
        audit.see(list(s[0][:-1]), NEVER)  # the server never scores the last step
        audit.observe(list(s[0]), list(c[0]))
    out["recalibrations"] = g.recalibrations
    return out


def restart_null(streams: int, audits: int, restart_every: int, *, seed: int,
                 grid: int = DEFAULT_GRID, epsilon: float = EPSILON,
                 delta: float = DELTA) -> tuple[float, float]:
    """The hardest null (every audit's loss Bernoulli(delta)), batched through the server's
    CensoredAlarm: the share of streams that ever alarm when one sequence runs through all
    audits (what a restart that resumes the journal keeps), and when a new, empty one starts
    every `restart_every` audits (what every start did before)."""
    from orca_method.audit.sequence import CensoredAlarm

    rng = np.random.default_rng(seed)
    whole = CensoredAlarm(epsilon, grid_size=grid, shape=(streams,))
    ever_whole = np.zeros(streams, bool)
    ever_fresh = np.zeros(streams, bool)
    fresh = None
    for i in range(audits):
        if i % restart_every == 0:
            fresh = CensoredAlarm(epsilon, grid_size=grid, shape=(streams,))
        x = (rng.random(streams) < delta).astype(float)
        whole.update(x)
        fresh.update(x)
        ever_whole |= whole.alarm(delta)
        ever_fresh |= fresh.alarm(delta)
    return float(ever_whole.mean()), float(ever_fresh.mean())


def give_up_pool(rng: np.random.Generator, n: int, *, right: float, bias: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Give-up losses of n simulated traces at one mu: (the audit's loss, the certified loss).

    A trace of T = 8 steps ends right with probability `right`; its give-up scores are
    sigmoid(1.5 (2 R - 1) + bias + N(0, 1)) per step, so traces that end wrong score lower and
    a negative `bias` makes every trace give up more. Both losses come from
    `request_give_up_loss` at mu = 0.2: the audit's with the outcome unknown (what live audits
    know), the certified one with the true outcome."""
    from orca_method.give_up import request_give_up_loss

    audit, certified = np.empty(n), np.empty(n)
    for i in range(n):
        r = bool(rng.random() < right)
        g = 1 / (1 + np.exp(-(1.5 * (2 * r - 1) + bias + rng.normal(size=8))))
        audit[i] = request_give_up_loss(g, 0.2, None)
        certified[i] = request_give_up_loss(g, 0.2, np.full(8, int(r)))  # right throughout, or never
    return audit, certified


def give_up_streams(audit: np.ndarray, certified: np.ndarray, delta: float, *, streams: int,
                    audits: int, seed: int, cut: float = 0.0, epsilon: float = EPSILON,
                    deltas: int = 1, grid: int = DEFAULT_GRID) -> tuple[float, float]:
    """Streams of audits drawn from a pool (`give_up_pool`) through a give-up guard's
    statistics (CensoredAlarm at `guard_epsilon(epsilon, deltas, "joint")`, per-delta when
    deltas is 1); an audit that gave up is cut (censored) with probability 3 `cut`, one that did
    not with probability `cut` (a cut that depends on the loss). Returns the share of streams
    whose upper bound was ever below the certified risk (the pool's mean certified loss), and
    the share that ever alarmed at `delta`."""
    from orca_method.audit.sequence import CensoredAlarm
    from orca_serve.live_audit.options import guard_epsilon

    rng = np.random.default_rng(seed)
    risk = float(certified.mean())
    cs = CensoredAlarm(guard_epsilon(epsilon, deltas, "joint"), grid_size=grid,
                       shape=(streams,))
    missed = np.zeros(streams, bool)
    ever = np.zeros(streams, bool)
    for _ in range(audits):
        x = audit[rng.integers(0, audit.size, streams)]
        cs.update(x, rng.random(streams) < np.where(x > 0, 3 * cut, cut))
        missed |= cs.upper < risk
        ever |= cs.alarm(delta)
    return float(missed.mean()), float(ever.mean())


# -- audits cut by max_tokens (issue 34 item 4) -------------------------------------------------
# how a cut audit enters the guard: "every-cut" (censored at every lambda, any loss in [0, 1]:
# the rule before, what the server does for an audit without a recording), "stop-before-cut"
# (its loss at a lambda that stops before the cut, censored with any loss past it: cut_feed as
# for an aborted audit) and "certified" (that, and past the cut its loss at the cut for the upper
# bound: cut_feed for a cut one, the server's rule now)
CUT_RULES = ("every-cut", "stop-before-cut", "certified")
RISK_015_BIAS = 0.325  # the bias at which the bundle's lambda*(0.1) has risk 0.15


def cut_recording(rng: np.random.Generator, s: np.ndarray, c: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """What the audit of a trajectory cut by max_tokens records: its steps up to a uniform
    step k in 1..T-1, labelled by consistency with the answer forced at the cut (calibration's
    convention): the true labels before k (a wrong answer before the first right one matches
    nothing after it, the right one stays right) and 1 at k."""
    k = int(rng.integers(1, STEPS))
    labels = c[:k + 1].copy()
    labels[k] = 1
    return s[:k + 1], labels


def _feed(rule: str, s: np.ndarray, labels: np.ndarray, lam: float) -> tuple[float, bool, float]:
    from orca_method.audit.attrition import CUT
    from orca_method.audit.guards import UNKNOWN, cut_feed

    if rule == "every-cut":
        return UNKNOWN
    return cut_feed(s, labels, lam, CUT if rule == "certified" else "aborted")


@lru_cache(maxsize=16)
def cut_truth(bias: float, share: float, ratio: float, seed: int = 777) -> tuple[float, float]:
    """(risk, certified risk) of the bundle's lambda*(delta) on the family with `bias` when a
    loss-dependent `share` is cut (`cut_probabilities`, `cut_recording`): the loss with the
    request's whole reasoning, and the loss of the population calibration certifies (a cut
    trajectory ends at its cut). Monte Carlo over the 100,000 trajectories of `_truth`."""
    lam = bundle().lam(DELTA)
    s, c = _truth(bias)
    loss = losses(stop_indices(list(s), np.asarray([lam])), list(c))[0].astype(float)  # [n]
    p0, p1 = cut_probabilities(float(loss.mean()), share, ratio)
    rng = np.random.default_rng(seed)
    cut = rng.random(len(s)) < np.where(loss > 0, p1, p0)
    certified = loss.copy()
    for i in np.flatnonzero(cut):
        x, known, _ = _feed("certified", *cut_recording(rng, s[i], c[i]), lam)
        certified[i] = 0.0 if known else x  # censored: its loss at the cut (worst) is 0 here
    return float(loss.mean()), float(certified.mean())


def cut_streams(bias: float, *, share: float, ratio: float, rule: str, streams: int,
                audits: int, seed: int, grid: int = DEFAULT_GRID) -> dict[str, np.ndarray]:
    """Audits of the family with `bias` at the bundle's lambda*(0.1), a loss-dependent `share`
    of them cut (`cut_probabilities`: a loss-1 audit `ratio` times as often; `cut_recording`),
    each entering the server's CensoredAlarm (batched over streams) by `rule` (CUT_RULES). Per
    stream: the audit of the first alarm (inf: none), whether [lower, upper] ever missed the
    risk and the certified risk (`cut_truth`), the final bounds and the censored share."""
    from orca_method.audit.sequence import CensoredAlarm

    lam = bundle().lam(DELTA)
    risk, certified = cut_truth(bias, share, ratio)
    p0, p1 = cut_probabilities(risk, share, ratio)
    rng = np.random.default_rng(seed)
    alarm = CensoredAlarm(EPSILON, grid_size=grid, shape=(streams,))
    first = np.full(streams, np.inf)
    missed = {"risk": np.zeros(streams, bool), "certified": np.zeros(streams, bool)}
    for i in range(1, audits + 1):
        s, c = trajectories(rng, streams, bias)
        loss = losses(stop_indices(list(s), np.asarray([lam])), list(c))[0].astype(float)
        cut = rng.random(streams) < np.where(loss > 0, p1, p0)
        fed = np.stack([loss, np.zeros(streams), np.ones(streams)])  # [3, streams]
        for j in np.flatnonzero(cut):
            fed[:, j] = _feed(rule, *cut_recording(rng, s[j], c[j]), lam)
        alarm.update(fed[0], fed[1].astype(bool), fed[2])
        for key, r in (("risk", risk), ("certified", certified)):
            missed[key] |= (alarm.lower > r) | (alarm.upper < r)
        first[np.isinf(first) & alarm.alarm(DELTA)] = i
    return {"first_alarm": first, "missed_risk": missed["risk"],
            "missed_certified": missed["certified"], "lower": alarm.lower,
            "upper": alarm.upper, "censored": alarm.censored / audits}


def fallback_clearing(seed: int, *, rule: str, share: float = 0.5, ratio: float = 3.0,
                      shifted: int = 150, clean: int = 5850) -> dict[str, float]:
    """`fallback` through the server's LiveAudit: `shifted` audits of the shifted family (none
    cut) make the guard fall back, then `clean` unshifted ones, `share` of them cut (loss
    dependent), each entering by `rule` (CUT_RULES; "every-cut": an outcome without its
    recording, as the server journals one). The clean audits until the guard serves the
    bundle's lambda* again (inf: never), and the final upper bound."""
    from orca_method.audit.attrition import CUT

    audit = LiveAudit(bundle(), AuditConfig(rate=1.0, on_alarm="fallback"))
    g = audit.state.guard(DELTA)
    lam = g.bundle_lam
    rng = np.random.default_rng(seed)
    s, c = trajectories(rng, shifted, SHIFT)
    for i in range(shifted):
        audit.observe(list(s[i]), list(c[i]))
    assert g.source == "fallback", "the shift did not make the guard fall back"
    risk = float(true_risk([lam], 0.0)[0])
    p0, p1 = cut_probabilities(risk, share, ratio)
    s, c = trajectories(rng, clean, 0.0)
    cleared = math.inf
    for i in range(clean):
        loss = int(losses(stop_indices([s[i]], np.asarray([lam])), [c[i]])[0, 0])
        if rng.random() >= (p1 if loss else p0):
            audit.observe(list(s[i]), list(c[i]))
        elif rule == "every-cut":
            audit.state.outcome(audit.state.admit(), "censored", cause=CUT)
        else:
            rs, rl = cut_recording(rng, s[i], c[i])
            audit.observe(list(rs), list(rl), censored=True,
                          cause=CUT if rule == "certified" else "aborted")
        if math.isinf(cleared) and g.source == "bundle":
            cleared = i + 1
    return {"cleared_after": cleared, "upper": float(g.cs.upper)}


def drift_alarms(biases: list[float], *, streams: int, seed: int, window: bool = True
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Requests until the bundle's drift tests alarm on a stream whose score bias follows
    `biases` (one request each), the reference built from 1,000 unshifted never-stopping
    replays per stream as `orca-calibrate calibrate` builds it: the sequential test's
    (`ConformalMartingale`) and the window test's (`DriftMonitor`, 500 requests, alpha
    spent over windows); inf where none within the stream. `window=False`: the sequential
    test alone (cheaper)."""
    from orca_method.audit.drift import DriftMonitor, build_reference
    from orca_method.audit.martingale import ConformalMartingale

    lam = bundle().lam(DELTA)
    seq_at, win_at = np.full(streams, np.inf), np.full(streams, np.inf)
    for j in range(streams):
        rng = np.random.default_rng([seed, j])
        s, _ = trajectories(rng, 1000, 0.0)
        ref = build_reference(list(s), 3, [lam], seed=j)
        seq, win = ConformalMartingale(ref, seed=j), DriftMonitor(ref) if window else None
        for i, bias in enumerate(biases):
            s, _ = trajectories(rng, 1, bias)
            scores = s[0][:-1]  # the server never scores the last step
            if not seq.alarm:
                seq.observe(scores)
                seq_at[j] = i + 1 if seq.alarm else np.inf
            if win is not None and not win.alarm:
                win.observe(scores)
                win_at[j] = i + 1 if win.alarm else np.inf
            if seq.alarm and (win is None or win.alarm):
                break
    return seq_at, win_at


class TableLabeller(AuditLabeller):
    """The server's labeller with its engine replaced by a table of each step's forced answer
    (our own fake of the engine call only: the rounds, prompts and records are the server's)."""

    def __init__(self, answers: dict[str, list[str]], texts: dict[str, str]) -> None:
        self.settings = ProbeSettings()
        self.suffix_ids: list[int] = []
        self.priority, self.probes = 0, 0
        self.answers, self.texts = answers, texts
        self.tokenizer: Any = None

    async def label(self, key: str, *args: Any, **kw: Any) -> dict[str, Any]:
        self.tokenizer = type("Tok", (), {"decode": lambda _, *a, **k: self.texts[key]})()
        return await super().label(key, *args, **kw)

    async def _answer(self, request_id: str, ids: list[int]) -> str | None:
        key, t = request_id.rsplit("-probe-", 1)
        self.probes += 1
        return self.answers[key][int(t)]


# -- give-up recalibrated from consistency labels (issue 34 item 4) -----------------------------
GIVE_UP_DELTA, GIVE_UP_MU = 0.1, 0.2  # the two-sided bundle's give-up row (certified in dist.)
GIVE_UP_SHIFT = -1.5  # the shifted family's give-up score bias: every trace gives up more


def give_up_trajectories(rng: np.random.Generator, n: int, bias: float
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stop scores [n, T], raw consistency labels [n, T] (the answer is the final one from a
    uniform step F on: `trajectories`) and give-up scores [n, T]: sigmoid(3 R - 1 -
    0.7 (1 - R) (t - F) + bias + N(0, 1)), R whether the trace ends right (70 %), so a trace
    that ends wrong gives up, mostly once its answer has settled; a negative `bias` makes
    every trace give up more, also before its answer settles (the shift)."""
    s, y = trajectories(rng, n, 0.0)
    first = STEPS - y.sum(axis=1)  # [n]
    right = rng.random(n) < 0.7
    t = np.arange(STEPS)
    wrong = ~right[:, None]
    z = (3.0 * right[:, None] - 1 - 0.7 * wrong * (t[None] - first[:, None]) + bias
         + rng.normal(0, 1, (n, STEPS)))
    return s, y, 1 / (1 + np.exp(-z))


@lru_cache(maxsize=4)
def _give_up_truth(bias: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return give_up_trajectories(np.random.default_rng(24680), 100_000, bias)


def true_give_up_risk(mus: list[float], bias: float) -> tuple[np.ndarray, np.ndarray]:
    """(consistency give-up risk, give-up rate) of the family with this bias, per mu."""
    from orca_method.give_up import consistency_give_up_losses, gave_up, give_up_indices

    _, y, g = _give_up_truth(bias)
    tau = give_up_indices(list(g), np.asarray(mus, dtype=float))  # [mus, n]
    return (consistency_give_up_losses(tau, list(y)).mean(axis=1),
            gave_up(tau, np.full(len(g), STEPS)).mean(axis=1))


@dataclass
class GiveUpStream:
    alarm_at: int | None = None  # audits until the bundle's give-up alarm
    served: list[float] = field(default_factory=list)  # the recalibrated mu after each audit
    # per served mu, the lowest upper bound of its risk it was served with: it missed its true
    # risk when that is below (`give_up_recalibration` computes the truths once, for all streams)
    lowest_upper: dict[float, float] = field(default_factory=dict)
    recalibrations: int = 0


def give_up_recalibrate_stream(seed: int, *, audits: int = 400, window: int = 150,
                               bias: float = GIVE_UP_SHIFT) -> GiveUpStream:
    """A two-sided bundle (the simulation's, mu* 0.2 at give-up delta 0.1) served the family
    with this give-up bias from the first audit, every request audited, `recalibrate`: through
    LiveAudit, which mu the give-up guard serves after each audit."""
    from tests.bundles import with_give_up

    audit = LiveAudit(with_give_up(bundle(), [(GIVE_UP_DELTA, GIVE_UP_MU)]),
                      AuditConfig(rate=1.0, on_alarm="recalibrate", window=window))
    g = audit.state.give_up_guard(GIVE_UP_DELTA)
    s, y, gs = give_up_trajectories(np.random.default_rng(seed), audits, bias)
    out = GiveUpStream()
    for i in range(audits):
        audit.observe(list(s[i]), list(y[i]), give_up=list(gs[i]))
        if out.alarm_at is None and g.engaged:
            out.alarm_at = i + 1
        if g.source == "audit":
            r = g.served
            out.served.append(r.mu)
            if r.cs.n:
                out.lowest_upper[r.mu] = min(r.cs.upper, out.lowest_upper.get(r.mu, np.inf))
    out.recalibrations = g.recalibrations
    return out


def give_up_recalibration(streams: int, *, audits: int = 400, window: int = 150,
                          bias: float = GIVE_UP_SHIFT, seed: int = 0) -> dict[str, float]:
    """`give_up_recalibrate_stream` over `streams` seeds: the share of streams ever served a
    recalibrated mu whose true give-up risk (consistency) on the family exceeds the give-up
    delta (bound: epsilon_2), whose served mu's upper bound ever missed its true risk, and
    the served mus' true risk and give-up rate (means over the audits served them), against
    the bundle's mu* on the same family."""
    runs = [give_up_recalibrate_stream(seed + k, audits=audits, window=window, bias=bias)
            for k in range(streams)]
    # one pass over the truth population for every mu at once (a pass per mu was most of the
    # simulation's time); the bundle's mu* last
    mus = sorted({m for r in runs for m in r.served})
    risk, rate = true_give_up_risk([*mus, GIVE_UP_MU], bias)
    at = dict(zip(mus, zip(risk, rate)))
    served = [m for r in runs for m in r.served]
    bundle_risk, bundle_rate = risk[-1:], rate[-1:]
    return {"streams": streams,
            "bad": float(np.mean([any(at[m][0] > GIVE_UP_DELTA for m in r.served)
                                  for r in runs])),
            "missed": float(np.mean([any(u < at[m][0] for m, u in r.lowest_upper.items())
                                     for r in runs])),
            "recalibrated": float(np.mean([r.recalibrations > 0 for r in runs])),
            "alarm_median": float(np.median([r.alarm_at or np.inf for r in runs])),
            "served_mu": float(np.mean(served)) if served else float("nan"),
            "served_risk": float(np.mean([at[m][0] for m in served])) if served else 0.0,
            "served_rate": float(np.mean([at[m][1] for m in served])) if served else 0.0,
            "bundle_risk": float(bundle_risk[0]), "bundle_rate": float(bundle_rate[0])}
