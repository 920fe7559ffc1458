"""Label-free early warning: do live requests' scores still behave like the calibration set's?

Labels of live requests arrive late and only for audited ones; the probe's scores exist for
every request at once. If live prompts are exchangeable with the calibration set (the premise of
LTT's guarantee), the scores' distribution is the calibration one; a significant difference
between them is evidence against that premise, before any realized risk moves. The converse
does not hold: equal score distributions do not imply equal risk (the labels can shift alone).

Statistics, per request (`drift_statistics`), chosen so that EARLY STOPPING DOES NOT CENSOR
THEM: a request stopped at its lambda has scores only up to the stop step, but every lambda it
can run with is at least ``level`` (the most aggressive lambda* of the bundle), so the first
crossing of ``level`` and everything before it are always observed:
- ``early_mean``: mean smoothed score over the first ``k`` steps, cut at that crossing;
- ``stop_step``: the 1-based step of that crossing, inf if the scores never reach ``level``
  (the would-stop step at the most aggressive delta).
The reference (`build_reference`, written by `orca-calibrate calibrate`) holds both for a
subsample of the calibration split, every problem included (the server cannot tell unsolvable
requests apart), each without its last step: the server never scores the step that the end of
thinking closes.

Test: two-sample Kolmogorov-Smirnov (scipy) of the last ``window`` requests against the
reference, for both statistics, combined by Bonferroni (p = min(1, 2 min(p1, p2))). KS p-values
treat the reference as the random sample it is; on the discrete ``stop_step`` they are
conservative. Repeated testing: a test runs every ``every`` requests (default: ``window``, so
windows do not overlap), and the j-th test alarms when p <= alpha / (j (j + 1)); these levels sum
to alpha, so under exchangeability the probability of ANY false alarm over an unbounded run is
<= alpha (union bound, valid although tests share the reference). The price: later tests need
smaller p-values. ``alarm`` is sticky (drift was detected at some test; a new bundle means a new
monitor); ``pvalue`` (the latest test's) is a monitoring statistic, not itself corrected for the
repetition. ``spend=False`` tests every window at alpha and ``alarming`` says whether the latest
test rejected: the test that decides whether a recalibrated lambda is trusted
(`orca_method.audit.guards.DeltaGuard.trust`), where a false rejection costs savings, not the guarantee.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy.stats import ks_2samp

from orca_method.thresholds import NEVER, lam_from_json, lam_to_json

if TYPE_CHECKING:
    from orca_method.bundle import Bundle, DriftReference

REFERENCE_SIZE = 500  # calibration trajectories kept in the bundle
DRIFT_WINDOW = 500  # requests per test: on the synthetic shift, 200 rarely detect it, 400 do
_NEVER = 1e9  # stop_step "never crossed", as a number KS can sort


def drift_statistics(scores: Sequence[float], k: int, level: float) -> tuple[float, float]:
    """``(early_mean, stop_step)`` of one request's smoothed scores (see the module docstring).

    ``level = inf`` (no delta stops early) makes ``stop_step`` always inf.
    """
    m = np.asarray(scores, dtype=float)
    if m.ndim != 1 or m.size == 0:
        raise ValueError("drift statistics need at least one score")
    crossed = np.flatnonzero(m >= level)
    first = int(crossed[0]) if crossed.size else None
    upto = min(k, m.size if first is None else first + 1)
    return float(m[:upto].mean()), math.inf if first is None else float(first + 1)


def reference_level(lambdas: Sequence[float]) -> float:
    """The most aggressive threshold a request can run with: the smallest lambda*."""
    return min(lambdas, default=NEVER)


def build_reference(scores: Sequence[np.ndarray], k: int, lambdas: Sequence[float],
                    seed: int = 0, size: int = REFERENCE_SIZE) -> DriftReference | None:
    """The bundle's drift reference from never-stopping replays of the calibration split; None
    when no trajectory has a scored step (the server never scores a trajectory's last step)."""
    from orca_method.bundle import DriftReference  # deferred: torch (live_audit stays numpy/scipy)

    level = reference_level(lambdas)
    usable = [np.asarray(s)[:-1] for s in scores if len(s) >= 2]
    if not usable:
        return None
    rng = np.random.default_rng(seed)
    keep = np.sort(rng.permutation(len(usable))[:size])
    stats = [drift_statistics(usable[i], k, level) for i in keep]
    return DriftReference(k=k, level=lam_to_json(level), n_cal=len(scores),
                          early_mean=[round(e, 6) for e, _ in stats],
                          stop_step=[None if math.isinf(s) else int(s) for _, s in stats])


class DriftMonitor:
    """Sliding-window KS test of live scores against the bundle's reference (module docstring).

    ``observe`` is O(1) but every ``every``-th call, which runs two KS tests on
    ``window + len(reference)`` values (well under a millisecond at the defaults).
    """

    def __init__(self, reference: DriftReference, window: int = DRIFT_WINDOW, alpha: float = 0.05,
                 every: int | None = None, spend: bool = True) -> None:
        if window < 10:
            raise ValueError(f"drift window must be >= 10 requests, got {window}")
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        self.reference = reference
        self.k = reference.k
        self.level = lam_from_json(reference.level)
        self.window = window
        self.alpha = alpha
        self.every = every or window
        # False: every test at alpha, for a test whose false alarm only costs savings (the
        # recalibrated lambda's, live.py), not a statement over the whole run
        self.spend = spend
        self._ref_early = np.asarray(reference.early_mean, dtype=float)
        self._ref_stop = np.array([_NEVER if s is None else s for s in reference.stop_step],
                                  dtype=float)
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)
        self.observed = 0  # requests that entered the window
        self.skipped = 0  # requests whose statistics were not observable (see observe)
        self.tests = 0
        # latest test's p-value; None before the first test (1.0 would read as a test passed)
        self.pvalue: float | None = None
        self.alarm = False  # some test so far rejected at its alpha-spending level (sticky)
        self.alarming = False  # the latest test rejected at its level (not sticky)
        self.alarms = 0  # tests that alarmed so far
        self._since = 0

    @classmethod
    def from_bundle(cls, bundle: Bundle, **kwargs: Any) -> DriftMonitor | None:
        """A monitor for the bundle's reference, or None for bundles without one."""
        return None if bundle.drift is None else cls(bundle.drift, **kwargs)

    def threshold(self, j: int) -> float:
        """The alpha-spending level of the j-th test (1-based): sum over j is alpha (alpha
        itself without spending)."""
        return self.alpha / (j * (j + 1)) if self.spend else self.alpha

    def observe(self, scores: Sequence[float], lam: float = NEVER) -> bool:
        """Add one finished request's smoothed scores (in step order, up to where it stopped).

        ``lam``: the threshold it ran with. Below the reference level a stop can come before
        the crossing the statistics need; such a request is skipped (returns False), as is one
        without scores or with a non-finite one.
        """
        m = np.asarray(scores, dtype=float)
        if m.ndim != 1 or m.size == 0 or not np.all(np.isfinite(m)):
            self.skipped += 1
            return False
        if lam < self.level and np.any(m >= lam) and not np.any(m >= self.level):
            self.skipped += 1
            return False
        early, stop = drift_statistics(m, self.k, self.level)
        self._recent.append((early, _NEVER if math.isinf(stop) else stop))
        self.observed += 1
        self._since += 1
        if len(self._recent) == self.window and self._since >= self.every:
            self._test()
        return True

    def _test(self) -> None:
        self._since = 0
        self.tests += 1
        recent = np.asarray(self._recent)  # [window, 2]
        p_early = ks_2samp(recent[:, 0], self._ref_early).pvalue
        p_stop = ks_2samp(recent[:, 1], self._ref_stop).pvalue
        self.pvalue = float(min(1.0, 2.0 * min(p_early, p_stop)))
        rejected = self.pvalue <= self.threshold(self.tests)
        self.alarms += int(rejected)
        self.alarm = self.alarm or rejected
        self.alarming = rejected

    def to_dict(self) -> dict[str, Any]:
        """Monitoring state (not the reference, which the bundle holds)."""
        return {"window": self.window, "alpha": self.alpha, "every": self.every,
                "recent": [list(r) for r in self._recent], "observed": self.observed,
                "skipped": self.skipped, "tests": self.tests, "pvalue": self.pvalue,
                "alarm": self.alarm, "alarming": self.alarming, "alarms": self.alarms,
                "since": self._since}

    @classmethod
    def from_dict(cls, reference: DriftReference, d: dict[str, Any]) -> DriftMonitor:
        mon = cls(reference, window=d["window"], alpha=d["alpha"], every=d["every"])
        mon._recent.extend((float(a), float(b)) for a, b in d["recent"])
        for name in ("observed", "skipped", "tests", "alarms"):
            setattr(mon, name, int(d[name]))
        mon.pvalue = None if d["pvalue"] is None else float(d["pvalue"])
        mon.alarm, mon._since = bool(d["alarm"]), int(d["since"])
        mon.alarming = bool(d.get("alarming", False))
        return mon
