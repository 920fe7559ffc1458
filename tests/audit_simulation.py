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
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from orca_method.ltt import calibrate, default_grid
from orca_method.probe import Probe, ProbeSpec
from orca_method.risk import losses, stop_indices
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig
from orca_serve.live_audit.sequence import DEFAULT_GRID, RESTART_EVERY, RestartedAlarm
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
    g = audit.guard(DELTA)
    rng = np.random.default_rng(seed)
    out = Stream()
    for bias, n in ((0.0, clean), (SHIFT, shifted)):
        s, c = trajectories(rng, n, bias)
        for i in range(n):
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
