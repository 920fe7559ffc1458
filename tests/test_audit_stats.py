"""The statistics of the live audit: the loss, the confidence sequence, the drift test.

Statistical claims are checked by simulation with fixed seeds and stated Monte Carlo
tolerances (3 binomial standard errors), using the very classes the server runs (batched over
independent streams where that keeps the test fast).
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from orca_method.audit.drift import DriftMonitor, build_reference, drift_statistics
from orca_method.audit.sequence import ConfidenceSequence, RestartedAlarm
from orca_method.bundle import BundleError, _checksum, load_bundle, save_bundle
from orca_method.ltt import calibrate
from orca_method.risk import is_counted, request_loss, request_losses, table_losses
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig
from orca_serve.settings.resolve import OrcaDefaults, resolve
from tests.audit_simulation import give_up_pool, give_up_streams, hardest_null, shift_delays
from tests.bundles import small_bundle
from tests.servers import orca_result

DEMO_BUNDLE = Path(__file__).parents[1] / "orca_serve" / "demo" / "bundle.json"


def _tolerance(rate: float, n: int) -> float:
    """3 binomial standard errors of a share estimated from n replicates."""
    return 3 * math.sqrt(rate * (1 - rate) / n)


# ---------------------------------------------------------------------------------- the loss


def _problems(rng: np.random.Generator, n: int) -> tuple[list, list]:
    scores, labels = [], []
    for _ in range(n):
        t = int(rng.integers(1, 40))
        scores.append(np.clip(np.cumsum(rng.normal(0.02, 0.1, t)) + 0.3, 0, 1))
        first = int(rng.integers(0, t))
        labels.append((np.arange(t) >= first).astype(np.int8))  # solvable, cumulative
    return scores, labels


def test_request_loss_follows_the_stopping_rule():
    scores, raw = [0.2, 0.6, 0.5, 0.9], [0, 1, 0, 1]  # raw labels are cumulated
    assert request_loss(scores, raw, 0.6) == 0  # stops at step 2 (>= is a stop), right there
    assert request_loss(scores, raw, 0.55) == 0
    assert request_loss(scores, raw, 0.1) == 1  # stops at step 1, not yet right
    assert request_loss(scores, raw, 0.95) == 0  # never crosses: runs to the end, right
    assert request_loss(scores, raw, math.inf) == 0
    assert request_loss(scores, [0, 0, 0, 0], math.inf) == 1  # never right: 1 at any lambda
    assert not is_counted([0, 0, 0, 0]) and is_counted([0, 0, 0, 0], False) and is_counted(raw)
    with pytest.raises(ValueError, match="one score per labelled step"):
        request_loss(scores, [0, 1], 0.5)


def test_request_loss_is_the_loss_ltt_certifies():
    """LTT's reported risk at its lambda* is the mean audit loss at that lambda*."""
    rng = np.random.default_rng(0)
    scores, labels = _problems(rng, 400)
    for res in calibrate(scores, labels, [0.1, 0.2, 0.3], epsilon=0.1):
        audit = np.mean([request_loss(s, c, res.lam) for s, c in zip(scores, labels)])
        assert audit == pytest.approx(res.risk, abs=1e-12)
    lams = [0.9, 0.5, 0.3, math.inf]
    for s, c in zip(scores[:50], labels[:50]):
        naive = []
        for lam in lams:
            hit = [t for t, m in enumerate(s) if m >= lam]
            naive.append(1 - int(c[hit[0] if hit else len(s) - 1]))
        assert request_losses(s, c, lams).tolist() == naive


class _Table:
    """The two methods of a bundle that table_losses reads."""

    def deltas(self):
        return [0.05, 0.1]

    def lam(self, delta):
        return {0.05: math.inf, 0.1: 0.5}[delta]


def test_table_losses_per_delta():
    assert table_losses(_Table(), [0.2, 0.6, 0.7], [0, 0, 1]) == {0.05: 0, 0.1: 1}


# ----------------------------------------------------------------------- confidence sequence


RISKS = np.repeat([0.01, 0.05, 0.1, 0.2, 0.5, 0.9], 100)  # 600 streams
HORIZON = 1000
ALPHA = 0.05


@pytest.fixture(scope="module")
def simulation():
    """600 Bernoulli audit streams of 1,000 losses each, through one batched sequence."""
    rng = np.random.default_rng(2024)
    cs = ConfidenceSequence(alpha=ALPHA, shape=RISKS.shape)
    missed = np.zeros(RISKS.shape, bool)
    low_missed = np.zeros(RISKS.shape, bool)
    for _ in range(HORIZON):
        cs.update((rng.random(RISKS.shape) < RISKS).astype(float))
        low_missed |= cs.lower > RISKS
        missed |= (cs.lower > RISKS) | (cs.upper < RISKS)
    return cs, missed, low_missed


def test_anytime_coverage(simulation):
    """The true risk ever leaves [lower, upper] in at most alpha of the streams (checked after
    every update, i.e. under continuous monitoring), and below lower (a false alarm at
    delta = risk) in at most alpha / 2."""
    _, missed, low_missed = simulation
    n = RISKS.size
    assert missed.mean() <= ALPHA + _tolerance(ALPHA, n)
    assert low_missed.mean() <= ALPHA / 2 + _tolerance(ALPHA / 2, n)


def test_bounds_tighten_and_alarm_on_excess_risk(simulation):
    cs, _, _ = simulation
    width = cs.upper - cs.lower
    # measured 0.070 at risk 0.1 (a fixed-n 95% Wilson interval: 0.037); 0.08 fails any
    # bound that does not shrink like sqrt(log log n / n)
    assert width[RISKS == 0.1].mean() < 0.08
    assert width[RISKS == 0.01].mean() < 0.03
    assert np.all(cs.lower < cs.upper)
    # risk 0.2 against delta 0.1: established within 1,000 audits in (nearly) every stream
    assert cs.alarm(0.1)[RISKS == 0.2].mean() >= 0.99
    assert not cs.alarm(0.1)[RISKS <= 0.05].any()


# ------------------------------------------------------------------- the restarted alarm
def test_restarted_alarm_false_alarm_rate_at_the_hardest_null():
    """Risk exactly delta in every audit: the family (a member every 10 audits over 600, so
    60 started and their dyadic survivors live) ever alarms in at most epsilon/2 of 200
    streams (+3 SE). A coarse grid keeps it fast; the server's grid: the slow test below."""
    share = hardest_null(ALPHA, streams=200, audits=600, every=10, grid=101, seed=7)
    assert share <= ALPHA / 2 + _tolerance(ALPHA / 2, 200), share


@pytest.mark.slow
def test_restarted_alarm_false_alarm_rate_on_the_production_grid():
    """The same on the server's grid (501 points) and restart period (50), 400 streams of
    3,000 audits (60 restarts): measured 1.0 % (bound epsilon/2 = 2.5 %)."""
    share = hardest_null(ALPHA, streams=400, audits=3000, every=50, grid=501, seed=8)
    assert share <= ALPHA / 2 + _tolerance(ALPHA / 2, 400), share


# ------------------------------------------------------------------- the give-up risk
@pytest.mark.parametrize("cut,deltas", [(0.0, 1), (0.05, 3)])
def test_give_up_bounds_cover_the_certified_risk(cut, deltas):
    """The audit's give-up loss (gave up, the outcome unknown) is at least the certified one,
    so the upper bound covers the certified give-up risk. Hardest case: every trace ends right,
    so the two losses are equal (risk 0.092). Over 300 streams of 500 audits the upper bound
    was ever below it in at most epsilon / 2 (+3 SE) of them, and the alarm at delta = the risk
    ever fired as often, also with a cut that depends on the loss (an audit that gave up cut 3
    times as often, 5 % / 15 %: censored) and under the joint split over the demo's three
    give-up deltas (epsilon / 3 each). Measured: 0.33 % / 0.33 % uncut, 0 % / 0 % cut."""
    audit, certified = give_up_pool(np.random.default_rng(4), 5000, right=1.0, bias=-0.7)
    assert np.array_equal(audit, certified)
    risk = float(certified.mean())
    missed, alarmed = give_up_streams(audit, certified, risk, streams=300, audits=500, seed=5,
                                      cut=cut, deltas=deltas, grid=101)
    bound = ALPHA / 2 + _tolerance(ALPHA / 2, 300)
    assert missed <= bound and alarmed <= bound, (missed, alarmed)


def test_give_up_alarm_catches_a_shift_and_also_fires_on_a_high_give_up_rate():
    """Power and its price. Traffic that gives up more (scores shifted down): the certified risk
    0.109 exceeds delta_2 0.05 and the alarm fires in (nearly) every stream within 400 audits.
    Traffic as calibrated: certified risk 0.007, but 42 % of the traces give up (the wrong
    ones), and the audit, which cannot tell them from right ones, alarms in every stream too:
    its alarm says the give-up RATE exceeds delta_2, not the certified risk (so the guard acts
    on it only with --orca-guard-other-labels: docs/AUDIT.md, "The give-up risk")."""
    shifted = give_up_pool(np.random.default_rng(2), 5000, right=0.6, bias=-1.0)
    calibrated = give_up_pool(np.random.default_rng(1), 5000, right=0.6, bias=0.0)
    assert shifted[1].mean() > 0.1 and calibrated[1].mean() < 0.01 < 0.4 < calibrated[0].mean()
    for pool in (shifted, calibrated):
        missed, alarmed = give_up_streams(*pool, 0.05, streams=100, audits=400, seed=3,
                                          grid=101)
        assert missed == 0.0 and alarmed >= 0.95, (missed, alarmed)


def test_dyadic_members_cover_every_shift():
    """For any shift at least 2 restarts ago some live member started in the first half of the
    shifted stretch (what keeps the delay from growing with the clean history), with about
    2 log2(restarts) members alive."""
    fam = RestartedAlarm(ALPHA, every=1, grid_size=3)
    for j in range(1, 513):
        fam.update(0.0)
        starts = [s for s, _ in fam.members]
        for shift in range(1, j - 1):
            assert any(shift <= s <= shift + (j - shift) / 2 for s in starts), (j, shift)
    assert starts[0] == 0 and len(starts) <= 2 * math.log2(512) + 3


def test_restarted_alarm_delay_does_not_grow_with_the_clean_history():
    """A moderate shift (0.05 -> 0.25 at delta 0.1), 40 streams: ten times the clean history
    (200 -> 2,000 audits) multiplies the family's median delay by less than 2.5 (measured
    108 -> 195: only the covering member's level falls, its threshold log(2 (j+1)(j+2) /
    epsilon) growing from 7.1 to 11.8), and the whole-history sequence alone (the alarm
    before restarts) takes at least twice as long."""
    short, _ = shift_delays(ALPHA, 200, 0.05, [0.25], streams=40, seed=11, grid=101)[0.25]
    long, whole = shift_delays(ALPHA, 2000, 0.05, [0.25], streams=40, seed=12, grid=101)[0.25]
    assert np.median(long) <= 2.5 * np.median(short), (np.median(short), np.median(long))
    assert np.median(whole) >= 2 * np.median(long), (np.median(long), np.median(whole))


@pytest.mark.slow
def test_recalibrate_rarely_serves_a_bad_lambda():
    """`--orca-on-alarm recalibrate` on 200 simulated streams (tests/audit_simulation.py: 50
    clean audits, then a shift that takes the bundle's risk at delta 0.1 from 0.085 to 0.567,
    600 shifted audits) through the server's LiveAudit: the share of streams in which a
    recalibrated lambda with true risk above delta was EVER served is at most epsilon (+3 SE).
    The sliding window refit after every audit did so in 21-30 % of such streams."""
    from tests.audit_simulation import EPSILON, bad_lambda_served, recalibrate_stream

    streams = [recalibrate_stream(seed) for seed in range(200)]
    assert all(st.alarm_at is not None and st.recalibrations >= 1 for st in streams)
    bad = bad_lambda_served(streams)
    assert bad.mean() <= EPSILON + _tolerance(EPSILON, 200), bad.mean()


def test_state_round_trips_through_json():
    rng = np.random.default_rng(1)
    a = ConfidenceSequence(alpha=0.1)
    for x in rng.random(301) < 0.3:  # 301: the state is saved between two folds
        a.update(float(x))
    b = ConfidenceSequence.from_dict(json.loads(json.dumps(a.to_dict())))
    assert (b.n, b.mean, b.lower, b.upper) == (a.n, a.mean, a.lower, a.upper)
    for x in rng.random(200) < 0.3:
        a.update(float(x))
        b.update(float(x))
        assert (b.lower, b.upper) == pytest.approx((a.lower, a.upper), abs=1e-12)
    assert 0.0 < a.lower < 0.3 < a.upper < 1.0 and a.alarm(0.05) and not a.alarm(0.5)


def test_fresh_sequence_and_bad_input():
    cs = ConfidenceSequence()
    assert cs.n == 0 and math.isnan(cs.mean) and (cs.lower, cs.upper) == (0.0, 1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        cs.update(1.5)
    with pytest.raises(ValueError, match="alpha"):
        ConfidenceSequence(alpha=0.0)
    with pytest.raises(ValueError, match="not a confidence sequence"):
        ConfidenceSequence.from_dict({"kind": "other"})


# -------------------------------------------------------------------------------------- drift


def _paths(rng: np.random.Generator, n: int, shift: float = 0.0) -> list[np.ndarray]:
    """Smoothed-score-like paths: a logistic random walk with a per-problem level."""
    out = []
    for _ in range(n):
        t = int(rng.integers(5, 60))
        z = rng.normal(-1.0 + shift, 1.0) + np.cumsum(rng.normal(0.08, 0.3, t))
        out.append(1 / (1 + np.exp(-z)))
    return out


def test_statistics_are_not_censored_by_stopping():
    """A request stopped at any lambda >= the reference level yields the statistics of its
    never-stopping run: what makes stopped live requests comparable to the reference."""
    rng = np.random.default_rng(3)
    level = 0.7
    for path in _paths(rng, 300):
        full = drift_statistics(path, 10, level)
        for lam in (0.7, 0.8, 0.95):
            hit = np.flatnonzero(path >= lam)
            stopped = path[:hit[0] + 1] if hit.size else path
            assert drift_statistics(stopped, 10, level) == full


def test_monitor_skips_requests_stopped_below_the_level():
    ref = build_reference(_paths(np.random.default_rng(4), 100), 10, [0.8, 0.9])
    mon = DriftMonitor(ref, window=10)
    assert not mon.observe([0.1, 0.75], lam=0.7)  # stopped at 0.75 < level 0.8: censored
    assert mon.observe([0.1, 0.85], lam=0.7)  # crossed the level too
    assert mon.observe([0.1, 0.2], lam=0.7) and not mon.observe([])
    assert not mon.observe([0.1, math.nan])
    assert (mon.observed, mon.skipped) == (2, 3)


@pytest.fixture(scope="module")
def reference():
    return build_reference(_paths(np.random.default_rng(5), 2000), 10, [0.8, 0.9])


def _alarm_share(reference, shift: float, monitors: int, requests: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    alarms = 0
    for _ in range(monitors):
        mon = DriftMonitor(reference, window=100, alpha=ALPHA)
        for path in _paths(rng, requests, shift):
            mon.observe(path[:-1])  # as build_reference: the last step is never scored
        alarms += mon.alarm
    return alarms / monitors


def test_drift_false_alarm_rate(reference):
    """In distribution: ANY alarm over 3 consecutive tests in at most alpha of the runs."""
    assert len(reference.early_mean) == 500 and reference.level == 0.8
    share = _alarm_share(reference, 0.0, monitors=200, requests=300, seed=6)
    assert share <= ALPHA + _tolerance(ALPHA, 200)


def test_drift_false_alarm_rate_with_clustered_choices(reference):
    """Requests with n = 8 choices that share the prompt's difficulty (one level per request,
    own walks per choice) through the server's LiveAudit: ANY alarm over 3 tests of 50-request
    windows in at most alpha of 200 runs (+3 SE). Feeding all 8 choices alarmed in 67 % (the
    review, 500-request windows)."""
    from tests.audit_simulation import bundle

    rng = np.random.default_rng(9)
    alarms = 0
    for _ in range(200):
        mon = DriftMonitor(reference, window=50, alpha=ALPHA)
        audit = LiveAudit(bundle(), AuditConfig(rate=0.0), drift=mon)
        settings = resolve({"messages": []}, OrcaDefaults(delta=0.1), bundle())[1]
        for _ in range(150):
            lengths = rng.integers(5, 60, 8)
            z = rng.normal(-1.0, 1.0) + np.cumsum(rng.normal(0.08, 0.3, (8, 60)), axis=1)
            paths = 1 / (1 + np.exp(-z))  # [8 choices, 60 steps], one level per request
            results = {i: orca_result(scores=paths[i, :n - 1].tolist(), lam=math.inf)
                       for i, n in enumerate(lengths)}
            audit.finished(settings, results, {i: "stop" for i in range(8)})
        alarms += mon.alarm
    assert alarms / 200 <= ALPHA + _tolerance(ALPHA, 200)


def test_drift_detects_a_shift(reference):
    assert _alarm_share(reference, 0.5, monitors=40, requests=200, seed=7) >= 0.9


def test_monitor_state_round_trips(reference):
    mon = DriftMonitor(reference, window=50, every=20)
    for path in _paths(np.random.default_rng(8), 130, 0.5):
        mon.observe(path)
    again = DriftMonitor.from_dict(reference, json.loads(json.dumps(mon.to_dict())))
    assert again.to_dict() == mon.to_dict() and mon.tests == 5
    assert mon.threshold(1) == ALPHA / 2 and sum(mon.threshold(j) for j in range(1, 10**5)) < ALPHA


# ------------------------------------------------------------------------------ the bundle


def test_bundle_reference_is_optional_and_checked(tmp_path, reference):
    old = small_bundle().model_dump()
    del old["drift"]  # a bundle written before the field existed, sealed as it was then
    old["checksum"] = _checksum(old)
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_bundle(tmp_path / "old.json").drift is None
    assert DriftMonitor.from_bundle(load_bundle(tmp_path / "old.json")) is None

    new = save_bundle(small_bundle().model_copy(update={"drift": reference}), tmp_path / "b.json")
    loaded = load_bundle(tmp_path / "b.json")
    assert loaded == new and loaded.drift == reference
    assert DriftMonitor.from_bundle(loaded).reference == reference
    assert loaded.summary()["drift"] == {"k": 10, "level": 0.8, "n_cal": 2000, "size": 500}
    assert build_reference([np.array([0.5])], 10, [0.8]) is None  # nothing the server scores

    data = json.loads((tmp_path / "b.json").read_text())
    data["drift"]["stop_step"] = data["drift"]["stop_step"][:-1]
    data["checksum"] = _checksum(data)
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="drift"):
        load_bundle(tmp_path / "b.json")


# ----------------------------------------------------------- censored audits (cut, aborted)
def test_censored_bounds_cover_the_whole_traffic_when_cuts_follow_the_loss():
    """15 % of the audits cut, a loss-1 audit cut 3 times as often (hard problems run long),
    200 streams of 1,000 audits at risk 0.1 through the server's CensoredAlarm: [lower, upper]
    ever misses the WHOLE traffic's risk (checked after every audit) in at most epsilon / 2 of
    the streams (+3 SE), and the risk range is the censored share wide. Dropping the cut
    audits, as the server did, measures 0.1 (1 - 0.24) / 0.85 = 0.089 (bias -0.011). A coarse
    grid keeps it fast; the server's grid: the slow test below."""
    from tests.audit_simulation import censored_streams

    res = censored_streams(0.1, share=0.15, ratio=3, streams=200, audits=1000, seed=31, grid=101)
    assert res["missed"].mean() <= ALPHA / 2 + _tolerance(ALPHA / 2, 200)
    width = res["range_high"] - res["range_low"]
    assert np.allclose(width, res["censored"]) and abs(width.mean() - 0.15) < 0.01
    assert not np.isfinite(res["first_alarm"]).any()  # risk = delta: no alarm


def test_censored_alarm_still_fires_on_a_large_excess():
    """Risk 0.3 with 10 % cut (3x likelier at loss 1): the alarm at delta 0.1 fires in every
    one of 100 streams within 600 audits, censored audits counted at loss 0."""
    from tests.audit_simulation import censored_streams

    res = censored_streams(0.3, share=0.1, ratio=3, streams=100, audits=600, seed=32, grid=101)
    assert np.isfinite(res["first_alarm"]).all()


@pytest.mark.slow
def test_censored_bounds_on_the_production_grid():
    """The issue's case on the server's grid (501) and restart period (50): 10 % of the audits
    cut, cuts 3x likelier at loss 1, 400 streams of 3,000 audits at risk 0.1: the displayed
    interval misses the whole traffic's risk in at most epsilon / 2 (+3 SE) of the streams
    (measured: 0.2 %, the run of benchmarks/bench_audit_stats.py --censored, which has the
    other figures of docs/AUDIT.md)."""
    from tests.audit_simulation import censored_streams

    res = censored_streams(0.1, share=0.1, ratio=3, streams=400, audits=3000, seed=51)
    assert res["missed"].mean() <= ALPHA / 2 + _tolerance(ALPHA / 2, 400)


# ------------------------------------------------------------ several deltas: joint bounds
def test_joint_split_bounds_the_false_alarms_of_all_deltas_at_once():
    """The demo's four deltas, each at its hardest null (independent across deltas, the worst
    case for the union), 200 streams of 300 audits, a member every 10 (grid 101): with
    `--orca-audit-epsilon-split joint` ANY delta ever alarms in at most epsilon / 2 of the
    streams (+3 SE). The production grid: the slow test below."""
    from tests.audit_simulation import joint_null

    share, per_delta = joint_null("joint", streams=200, audits=300, seed=41, every=10, grid=101)
    assert share <= ALPHA / 2 + _tolerance(ALPHA / 2, 200), (share, per_delta)


@pytest.mark.slow
def test_joint_split_on_the_production_grid():
    """The same on the server's grid and restart period, 200 streams of 2,000 audits (measured
    0.5 %, benchmarks/bench_audit_stats.py --joint --streams 200 --audits 2000)."""
    from tests.audit_simulation import joint_null

    share, per_delta = joint_null("joint", streams=200, audits=2000, seed=61)
    assert share <= ALPHA / 2 + _tolerance(ALPHA / 2, 200), (share, per_delta)


def test_joint_split_reaches_the_guards_and_the_table():
    """`joint` gives each of the k deltas' guards epsilon / k (their alarms and their
    recalibration budgets), and the table says which split is in force."""
    from orca_method.audit.guards import recalibration_epsilon
    from tests.audit_simulation import bundle

    b = load_bundle(DEMO_BUNDLE)
    assert len(b.deltas()) == 4
    for split, k in (("per-delta", 1), ("joint", 4)):
        audit = LiveAudit(b, AuditConfig(rate=1.0, epsilon_split=split))
        eps = b.ltt.epsilon / k
        assert audit.table()["epsilon_split"] == split
        assert audit.table()["guard_epsilon"] == pytest.approx(eps)
        for g in audit.state.guards.values():
            assert g.epsilon == pytest.approx(eps)
            assert g.cs.alarm_side.epsilon == pytest.approx(eps)
            assert recalibration_epsilon(g.epsilon, 1) == pytest.approx(eps / 2)
    with pytest.raises(ValueError, match="epsilon_split"):
        LiveAudit(bundle(), AuditConfig(epsilon_split="half"))


@pytest.mark.slow
def test_distrusting_a_drifting_recalibrated_lambda_serves_fewer_bad_audits():
    """`recalibrate` under a gradual drift (tests/audit_simulation.py drift_stream: the score
    bias grows from 0 to 3 over 2,000 audits, so every recalibrated lambda goes bad while it
    is served), 4 streams: with the recalibrated lambda's drift test the audits served a
    lambda bad for the current traffic fall by at least 5 % in total (measured 3,268 -> 2,934,
    -10 %; benchmarks/RESULTS.md has the 6-stream figures)."""
    from tests.audit_simulation import drift_stream

    without = sum(drift_stream(seed, distrust=False)["bad"] for seed in range(4))
    with_test = sum(drift_stream(seed)["bad"] for seed in range(4))
    assert with_test <= 0.95 * without, (with_test, without)


# ------------------------------------------------- the sequential drift test (issue 34 item 4)
def _reference_of(values: np.ndarray):
    """A drift reference whose statistics are `values` (early means; never crossing)."""
    from orca_method.bundle import DriftReference

    return DriftReference(k=3, level=0.5, n_cal=len(values), early_mean=[float(v) for v in values],
                          stop_step=[None] * len(values))


def _martingale_streams(streams: int, requests: int, seed: int, draw) -> np.ndarray:
    """Per stream: the request (1-based) at which the sequential test first alarmed, inf if
    never; the reference 500 draws of the null (uniform on [0, 1], to 0.05: with ties), the
    live statistics `draw(rng, requests)`, drawn at once (the values one draw per request
    would give: the same stream of the same generator)."""
    from orca_method.audit.martingale import ConformalMartingale

    at = np.full(streams, np.inf)
    for j in range(streams):
        rng = np.random.default_rng([seed, j])
        mart = ConformalMartingale(_reference_of(np.round(rng.random(500) * 20) / 20), seed=j)
        for x in draw(rng, requests):
            mart.test(x)
            if mart.alarm:
                at[j] = mart.alarm_at
                break
    return at


def test_sequential_drift_false_alarm_rate_is_at_most_alpha():
    """Exchangeable traffic (the live statistics drawn as the reference's, ties included), 400
    streams of 1,500 requests: the test martingale ever reaches 1/alpha in at most alpha of them
    (+3 SE), although every stream shares its reference with all its requests (the online
    p-values: without them a stream whose reference is unlucky alarms for ever)."""
    at = _martingale_streams(400, 1500, 101, lambda rng, n: np.round(rng.random(n) * 20) / 20)
    share = float(np.isfinite(at).mean())
    assert share <= 0.05 + _tolerance(0.05, 400), share


def test_sequential_drift_alarms_within_tens_of_requests_of_an_abrupt_shift():
    """Live statistics shifted up by 0.5 from the first request: the test alarms in every one
    of 100 streams, after a median of at most 40 requests; a shift down (later stops: savings,
    not the guarantee) is not what it looks for and alarms in at most alpha of them (+3 SE)."""
    up = _martingale_streams(100, 300, 102, lambda rng, n: rng.random(n) + 0.5)
    assert np.isfinite(up).all() and np.median(up) <= 40, np.median(up)
    down = _martingale_streams(100, 300, 103, lambda rng, n: rng.random(n) - 0.5)
    assert np.isfinite(down).mean() <= 0.05 + _tolerance(0.05, 100)


def test_sequential_drift_test_skips_what_stopping_censors():
    """The request statistics are the window test's (`drift_statistics`); a request that ran
    below the reference level is not tested, whether it crossed the level or not (leaving out
    only the ones that stopped before it would select by the scores)."""
    from orca_method.audit.martingale import ConformalMartingale, statistic

    ref = _reference_of(np.linspace(0, 0.4, 50))
    mart = ConformalMartingale(ref)
    assert not mart.observe([0.1, 0.45], lam=0.4)  # stopped at 0.45 < level 0.5
    assert not mart.observe([0.1, 0.55], lam=0.4)  # crossed the level too: still skipped
    assert mart.observe([0.1, 0.2, 0.6]) and (mart.observed, mart.skipped) == (1, 2)
    assert statistic(0.2, 3) == pytest.approx(0.2 + 1 / 3) and statistic(0.2, math.inf) == 0.2
    assert mart.to_dict()["capital"] == pytest.approx(mart.capital)
