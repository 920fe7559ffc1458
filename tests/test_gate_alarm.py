"""The gate alarm (orca_method/gate_alarm.py): its false-alarm level over repeated calibrations,
its detection delay, its clearing, and its reading of the gate's p-values. Statistical claims are
checked by simulation with fixed seeds; each tolerance is stated where it is used."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from orca_method.gate_alarm import GateAlarm, flag_rate_bound, requests_to_alarm
from orca_method.shift_gate import flag_count, pvalue, threshold

N_CAL, ALPHA = 297, 0.05  # the toy bundle's gate: 297 calibration scores, alpha 0.05


def _calibrated_flags(rng: np.random.Generator, n: int, alpha: float, t: int) -> np.ndarray:
    """t in-distribution requests' flags given one fresh calibration set of n scores (uniform:
    the gate's p-values depend on ranks only)."""
    cal = np.sort(rng.random(n))
    thr = threshold(list(cal), alpha)
    return rng.random(t) > thr


def test_bound_holds_over_calibrations_where_alpha_does_not() -> None:
    """The conditional flag rate r = 1 - s_(n+1-m) exceeds alpha for a large share of
    calibration sets, but exceeds b(eps) for at most eps of them (20,000 calibrations; the
    tolerance is 4 binomial standard errors)."""
    rng = np.random.default_rng(0)
    n, eps, reps = N_CAL, 0.05, 20_000
    m = flag_count(n, ALPHA)
    r = 1 - np.sort(rng.random((reps, n)), axis=1)[:, n - m]
    b = flag_rate_bound(n, ALPHA, eps)
    assert (r > ALPHA).mean() > 0.3  # the naive bound alpha fails often
    assert abs((r > b).mean() - eps) < 4 * np.sqrt(eps * (1 - eps) / reps)


@pytest.mark.parametrize("n", [50, N_CAL])
def test_false_alarm_level_over_repeated_calibrations(n: int) -> None:
    """In distribution, P(ever alarm within 2,000 requests) <= level, over 300 calibration sets
    each with its own stream (level 0.1 so that the check has resolution; an observed rate above
    level + 3 standard errors, 0.152, would have probability < 0.2% if the level held)."""
    rng = np.random.default_rng(1)
    level, reps = 0.1, 300
    alarms = sum(requests_to_alarm(GateAlarm(n, ALPHA, level),
                                   list(_calibrated_flags(rng, n, ALPHA, 2000))) is not None
                 for _ in range(reps))
    assert alarms / reps <= level + 3 * np.sqrt(level * (1 - level) / reps)


def test_martingale_level_at_the_bound() -> None:
    """The worst null the bet is built for: flags i.i.d. at exactly the bound b. Ville's
    inequality gives P(ever) <= gamma = level / 2 (400 streams of 2,000; tolerance 3 standard
    errors)."""
    rng = np.random.default_rng(2)
    level, reps = 0.1, 400
    b = GateAlarm(N_CAL, ALPHA, level).bound
    alarms = sum(requests_to_alarm(GateAlarm(N_CAL, ALPHA, level), list(rng.random(2000) < b))
                 is not None for _ in range(reps))
    gamma = level / 2
    assert alarms / reps <= gamma + 3 * np.sqrt(gamma * (1 - gamma) / reps)


@pytest.mark.parametrize(("rate", "before", "most"), [
    (0.86, 0, 6), (0.5, 0, 15), (0.86, 1000, 16), (0.5, 1000, 45)])
def test_detection_delay(rate: float, before: int, most: int) -> None:
    """Median requests from the first shifted request to the alarm at the default level, at flag
    rates 0.86 (the long reasoner's shifted family) and 0.5, right at the start and after 1,000
    in-distribution requests (200 streams; measured 4 / 9.5 / 11 / 32)."""
    rng = np.random.default_rng(3)
    delays = []
    for _ in range(200):
        flags = list(rng.random(before) < ALPHA) + list(rng.random(1000) < rate)
        t = requests_to_alarm(GateAlarm(N_CAL, ALPHA), flags)
        assert t is not None
        delays.append(t - before)
    assert statistics.median(delays) <= most
    assert min(delays) >= 1  # none raised before the shift (not guaranteed; 0 of 200 here)


def test_clears_when_traffic_returns_and_holds_while_shifted() -> None:
    """Raised, the alarm clears on in-distribution traffic (median <= 150 requests; measured
    90), and stays raised on traffic flagged at the clear rate c (P(clears within 2,000) <=
    gamma, 300 streams at level 0.1, 3 standard errors)."""
    rng = np.random.default_rng(4)
    hi, lo = 1 / (N_CAL + 1), 1.0
    delays = []
    for _ in range(100):
        a = GateAlarm(N_CAL, ALPHA)
        assert requests_to_alarm(a, [True] * 20) is not None
        for i in range(1, 2000):
            if a.observe(hi if rng.random() < ALPHA else lo).cleared:
                delays.append(i)
                break
    assert len(delays) == 100 and statistics.median(delays) <= 150
    level, reps, cleared = 0.1, 300, 0
    for _ in range(reps):
        a = GateAlarm(N_CAL, ALPHA, level)
        assert requests_to_alarm(a, [True] * 20) is not None
        cleared += any(a.observe(hi if f else lo).cleared
                       for f in rng.random(2000) < a.clear_rate)
    gamma = level / 2
    assert cleared / reps <= gamma + 3 * np.sqrt(gamma * (1 - gamma) / reps)


def test_detects_again_after_a_clear() -> None:
    a = GateAlarm(N_CAL, ALPHA)
    hi, lo = 1 / (N_CAL + 1), 1.0
    assert requests_to_alarm(a, [True] * 20) is not None
    assert any(a.observe(lo).cleared for _ in range(500))
    assert requests_to_alarm(a, [True] * 20) is not None
    assert (a.raised, a.cleared, a.alarmed) == (2, 1, True)
    assert a.observe(hi).raised is False  # raised already: only a clear changes it now


def test_reads_the_gates_own_decision_from_its_pvalue() -> None:
    """flagged(p) is the gate's decision s > threshold(alpha), for every score between and on
    the calibration scores (ties included)."""
    rng = np.random.default_rng(5)
    for n, alpha in ((N_CAL, ALPHA), (19, 0.05), (99, 0.1), (300, 0.2)):
        cal = sorted(np.round(rng.random(n), 2).tolist())  # ties on purpose
        a = GateAlarm(n, alpha)
        thr = threshold(cal, alpha)
        for s in cal + (rng.random(200) * 1.2 - 0.1).tolist():
            assert a.flagged(pvalue(cal, s)) == (s > thr)


def test_a_gate_that_cannot_flag_never_alarms() -> None:
    a = GateAlarm(10, 0.05)  # m = floor(0.55) = 0: the gate flags nothing at this alpha
    assert not a.usable
    assert requests_to_alarm(a, [True] * 100) is None and a.seen == 100


def test_level_is_checked() -> None:
    with pytest.raises(ValueError, match="level"):
        GateAlarm(N_CAL, ALPHA, level=0.0)
