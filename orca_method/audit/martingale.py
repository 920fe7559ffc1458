"""A sequential, label-free drift alarm: a conformal test martingale over every request's scores.

The window test (`orca_method.audit.drift.DriftMonitor`) needs a full window of requests
(500 for the bundle's) before it can say anything, and spends its level over windows. This
test can alarm after tens of requests and watches every request as it ends, with a false-alarm
probability at most ``alpha`` over an unbounded stream.

Statistic. One number per request, from the drift statistics that early stopping does not
censor (`drift_statistics`): ``x = early_mean + 1 / stop_step`` (``1 / inf = 0``). It grows when
a request's scores are higher or cross the bundle's most aggressive lambda* earlier, the
direction in which a fixed lambda stops earlier and its risk can grow; a drift the other way
(later stops) costs savings, not the guarantee, and this test does not look for it.

Online conformal p-values (Vovk, Gammerman & Shafer, "Algorithmic Learning in a Random World",
2005, ch. 7): the bag starts as the reference's statistics (calibration requests, or a
recalibration window's audits: exchangeable with live requests while the traffic is unchanged)
and every request joins it after its p-value

    p_t = (#{bag > x_t} + U_t (#{bag == x_t} + 1)) / (|bag| + 1),  U_t ~ Uniform(0, 1),

the smoothed rank of x_t among the bag and itself (small: larger than most). If the reference
and the live requests are exchangeable, p_1, p_2, ... are independent and uniform on (0, 1)
(their Theorem 8.1, the online mode: each is uniform given the bags after it), although all
share the reference. (Against a FIXED reference they would not be: they share its draw, and a
bettor who wins slowly on an unlucky reference wins for ever; so every request joins the bag.)

Betting (a test martingale): the capital S_t = prod (betting factor) with factors
``f_k(p) = 1 + k (1 - 2 p)`` for k in KAPPAS (mean 1 under the uniform, up to 1 + k when p is
near 0), mixed as Vovk's Simple Jumper does ("Retrain or not retrain: conformal test martingales
for change-point detection", Vovk, Petej, Nouretdinov, Ahlberg, Carlsson & Gammerman, 2021):
before each request a share ``jump`` of the capital is spread evenly over the bets again, so a
bet that lost during a long stretch of unchanged traffic is back in play when the traffic
moves. Each step multiplies S by an average of factors with conditional mean 1, so S is a
nonnegative martingale with S_0 = 1, and by Ville's inequality P(S_t >= 1 / alpha for some t)
<= alpha. The alarm fires when the capital first reaches ``1 / alpha`` and is sticky.

Per process, like the window test: each process's test sees its own requests (each a valid
test on its own; a fleet of P processes alarms falsely with probability <= P alpha) and starts
empty after a restart; its alarm is journalled, so every process acts on it.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from orca_method.audit.drift import drift_statistics
from orca_method.thresholds import NEVER, lam_from_json

if TYPE_CHECKING:
    from orca_method.bundle import Bundle, DriftReference

KAPPAS = (0.0, 0.5, 1.0)  # bet sizes: none, half, full (factor 1 + k (1 - 2p))
JUMP = 0.01  # share of the capital spread evenly over the bets before each request
SEQUENTIAL_ALPHA = 0.05


def statistic(early_mean: float, stop_step: float | None) -> float:
    """The test's one number per request (module docstring); `stop_step` None or inf: never."""
    return early_mean + (0.0 if stop_step is None or math.isinf(stop_step) else 1.0 / stop_step)


class ConformalMartingale:
    """The test martingale of the module docstring over a reference's statistics.

    ``observe`` costs one insertion into a sorted list (O(log n) to find, O(n) to move: about
    a microsecond per thousand requests seen) and a few float operations.
    """

    def __init__(self, reference: DriftReference, alpha: float = SEQUENTIAL_ALPHA,
                 jump: float = JUMP, seed: int | None = 0) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if not 0.0 <= jump <= 1.0:
            raise ValueError(f"jump must be in [0, 1], got {jump}")
        self.reference = reference
        self.k = reference.k
        self.level = lam_from_json(reference.level)
        self.alpha, self.jump = float(alpha), float(jump)
        self._bag = sorted(statistic(e, s) for e, s in zip(reference.early_mean,
                                                            reference.stop_step))
        # the capital S_t = exp(log_capital), split over the bets in the shares `_shares`
        # (kept apart so that a long unchanged stretch cannot underflow it)
        # (Python floats: three numbers, where numpy's per-call overhead was most of `test`)
        self._shares = [1.0 / len(KAPPAS)] * len(KAPPAS)
        self.log_capital = 0.0
        self._rng = random.Random(seed)  # the smoothing U_t: nothing of the request
        self.observed = 0  # requests tested
        self.skipped = 0  # requests whose statistics were not observable (as DriftMonitor)
        self.pvalue: float | None = None  # the latest request's p-value
        self.alarm = False  # the capital reached 1 / alpha at some request (sticky)
        self.alarm_at: int | None = None  # the request (1-based) it first did
        self.peak = 1.0  # the largest capital so far

    @classmethod
    def from_bundle(cls, bundle: Bundle, **kwargs: Any) -> ConformalMartingale | None:
        """A test against the bundle's drift reference, or None for bundles without one."""
        return None if bundle.drift is None else cls(bundle.drift, **kwargs)

    @property
    def capital(self) -> float:
        """S_t: 1 at the start; the alarm fires at 1 / alpha."""
        return math.exp(self.log_capital)

    def observe(self, scores: Sequence[float], lam: float = NEVER) -> bool:
        """Add one finished request's smoothed scores (in step order, up to where it stopped;
        `lam`: the threshold it ran with). Returns whether it was tested: a request without
        scores or with a non-finite one is skipped, and so is EVERY request that ran below the
        reference level, whatever its scores: one that stopped before the crossing its
        statistics need would otherwise be left out and one that crossed kept, a choice by its
        scores that makes the kept ones look drifted (a server test's bundle serves lambda 0
        at one delta, below its reference's level, and alarmed so)."""
        m = np.asarray(scores, dtype=float)
        if m.ndim != 1 or m.size == 0 or not np.all(np.isfinite(m)) or lam < self.level:
            self.skipped += 1
            return False
        early, stop = drift_statistics(m, self.k, self.level)
        self.test(statistic(round(early, 6), stop))  # rounded as the reference is
        return True

    def test(self, x: float) -> float:
        """One request's statistic: its p-value, the bet, then it joins the bag. Returns p."""
        lo, hi = bisect.bisect_left(self._bag, x), bisect.bisect_right(self._bag, x)
        n = len(self._bag)
        p = ((n - hi) + self._rng.random() * (hi - lo + 1)) / (n + 1)
        bisect.insort(self._bag, x)
        spread, edge = self.jump / len(KAPPAS), 1.0 - 2.0 * p
        shares = [((1 - self.jump) * s + spread) * (1.0 + k * edge)  # the jump, then the bets
                  for s, k in zip(self._shares, KAPPAS)]
        growth = sum(shares)  # S_t / S_{t-1}: conditional mean 1 under the null (in order,
        # as numpy summed the three)
        self._shares = [s / growth for s in shares]
        self.log_capital += math.log(growth)
        self.observed += 1
        self.pvalue = p
        self.peak = max(self.peak, self.capital)
        if not self.alarm and self.log_capital >= math.log(1.0 / self.alpha):
            self.alarm, self.alarm_at = True, self.observed
        return p

    def to_dict(self) -> dict[str, Any]:
        """What the table shows (the bag and the capital are the process's own)."""
        return {"alpha": self.alpha, "observed": self.observed, "skipped": self.skipped,
                "capital": self.capital, "peak": self.peak, "pvalue": self.pvalue,
                "alarm": self.alarm, "alarm_at": self.alarm_at}
