"""Live-audit logic without an engine: sampling, score alignment, the guard, the store, admission.

The engine-side path (labels through the real server) is tests/test_audit_server.py.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binomtest

from orca_method.audit.drift import DriftMonitor, build_reference
from orca_method.audit.guards import DeltaGuard, GiveUpGuard, aligned_scores
from orca_method.bundle import load_bundle
from orca_method.risk import request_loss
from orca_method.trajectories import TrajectorySet
from orca_serve.settings.contract import OrcaResult
from orca_serve.live_audit.collector import AuditCollector
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig
from orca_serve.live_audit.sampling import AuditSampler
from orca_serve.live_audit.store import AuditStore
from orca_serve.api_server.report import orca_object
from orca_serve.settings.resolve import OrcaDefaults, resolve
from tests.servers import orca_result

DEMO_BUNDLE = Path(__file__).parents[1] / "orca_serve" / "demo" / "bundle.json"


@pytest.fixture(scope="module")
def bundle():
    return load_bundle(DEMO_BUNDLE)


class FakeCS:
    """A confidence sequence whose bounds the test sets (the guard only reads them)."""

    def __init__(self) -> None:
        self.n, self.censored, self.mean, self.lower, self.upper = 0, 0, 0.0, 0.0, 1.0
        self.losses: list[float | None] = []  # None: censored
        self.worst: list[float | None] = []  # a censored audit's upper imputation

    def update(self, loss: float, censored: bool = False, worst: float = 1.0) -> None:
        self.losses.append(None if censored else loss)
        self.worst.append(worst if censored else None)
        self.n = len(self.losses)
        self.censored += int(censored)
        known = [x for x in self.losses if x is not None]
        self.mean = float(np.mean(known)) if known else math.nan

    def alarm(self, delta: float) -> bool:
        return self.lower > delta

    def alarm_source(self, delta: float) -> tuple[int | None, float | None]:
        return (0, self.lower) if self.alarm(delta) else (None, None)


def _loss(scores: np.ndarray, labels: np.ndarray, lam: float) -> int:
    hit = np.flatnonzero(scores >= lam)
    tau = min(int(hit[0]), len(labels) - 1) if hit.size else len(labels) - 1
    return int(1 - labels[tau])


# -- sampling ---------------------------------------------------------------------------------
def test_sampling_rate_within_binomial_tolerance_over_seeds() -> None:
    """200 seeds x 2000 requests at r = 0.1: a two-sided binomial test at level 0.01 rejects for
    about 1% of seeds if the draws are Bernoulli(r); allow up to 5 of 200."""
    rejected = 0
    for seed in range(200):
        s = AuditSampler(0.1, seed)
        k = sum(s.pick() for _ in range(2000))
        rejected += binomtest(k, 2000, 0.1).pvalue < 0.01
    assert rejected <= 5, rejected


def _body(kind: str, i: int) -> dict:
    text = "Find x with 3*x + 2 = 11." if kind == "short" else "Solve for x: " + "long " * 200
    return {"model": "m", "messages": [{"role": "user", "content": f"{text} #{i}"}],
            "orca": {"delta": 0.1 if kind == "short" else 0.2}}


def _picks(bundle, bodies: list[dict], seed: int) -> list[bool]:
    audit = LiveAudit(bundle, AuditConfig(rate=0.3, seed=seed), cs_factory=FakeCS, loss=_loss)
    out = []
    for body in bodies:
        _, settings = resolve(body, OrcaDefaults(delta=0.1), bundle, thresholds=audit)
        out.append(settings.audited)
    return out


def test_picks_do_not_depend_on_content(bundle) -> None:
    """Same seed, different request streams: the same requests (by position) are picked, so the
    decision cannot depend on the prompt, its length or its delta. Per kind the rate holds."""
    n = 3000
    kinds = ["short" if (i * 7919) % 3 else "long" for i in range(n)]
    a = _picks(bundle, [_body(k, i) for i, k in enumerate(kinds)], seed=5)
    b = _picks(bundle, [_body("short", i) for i in range(n)], seed=5)
    assert a == b
    for kind in ("short", "long"):
        picked = [p for p, k in zip(a, kinds) if k == kind]
        assert binomtest(sum(picked), len(picked), 0.3).pvalue > 0.001
    assert _picks(bundle, [_body("short", i) for i in range(200)], seed=6) != b[:200]


def test_disabled_and_rate_zero_requests_are_never_audited(bundle) -> None:
    audit = LiveAudit(bundle, AuditConfig(rate=0.0, seed=1), cs_factory=FakeCS, loss=_loss)
    body, settings = resolve({"messages": []}, OrcaDefaults(delta=0.1), bundle, thresholds=audit)
    assert not settings.audited and "orca_record" not in body["vllm_xargs"]
    assert body["vllm_xargs"]["orca_lam"] == bundle.lam(0.1)
    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=1), cs_factory=FakeCS, loss=_loss)
    _, settings = resolve({"messages": [], "orca": {"enabled": False}}, OrcaDefaults(), bundle,
                          thresholds=audit)
    assert not settings.audited and audit.counts["picked"] == 0  # no draw for it


def test_audited_request_runs_in_shadow_with_record_mode(bundle) -> None:
    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=1), cs_factory=FakeCS, loss=_loss)
    body, settings = resolve({"messages": [{"role": "user", "content": "q"}],
                              "orca": {"policy": "answer"}}, OrcaDefaults(delta=0.1), bundle,
                             thresholds=audit)
    xa = body["vllm_xargs"]
    assert xa["orca_policy"] == "shadow" and xa["orca_record"] == 1 and xa["orca_key"]
    obj = orca_object(settings, {0: orca_result(policy="shadow")})
    assert obj["audited"] is True and obj["lambda_source"] == "bundle"


# -- scores and losses -----------------------------------------------------------------------
def test_aligned_scores_fill_only_the_last_step() -> None:
    assert aligned_scores([0.2, 0.9], 3).tolist() == [0.2, 0.9, 0.0]
    assert aligned_scores([0.2, 0.9, 0.4], 3).tolist() == [0.2, 0.9, 0.4]
    assert aligned_scores([0.2], 3) is None  # a middle step missing: not comparable
    assert aligned_scores([0.2, float("nan")], 3) is None


def test_filled_last_score_never_changes_a_loss() -> None:
    """The stop time (first crossing, else the last step) is the same whatever the last score."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        t = int(rng.integers(1, 9))
        s = rng.random(t - 1)
        c = np.maximum.accumulate(rng.integers(0, 2, t))
        lam = float(rng.random())
        filled = aligned_scores(s, t)
        for last in (0.0, 1.0, float(rng.random())):
            assert request_loss(filled, c, lam) == request_loss(np.append(s, last), c, lam)


# -- the guard --------------------------------------------------------------------------------
def _window(n: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    scores, labels = [], []
    for _ in range(n):
        t = int(rng.integers(3, 8))
        right = int(rng.integers(0, t))
        labels.append((np.arange(t) >= right).astype(np.int8))
        scores.append(np.clip(np.arange(t) / t + rng.normal(0, 0.1, t), 0, 1))
    return scores, labels


def _no_ltt(scores, labels, delta, epsilon):
    raise AssertionError("report and fallback never recalibrate")


@pytest.mark.parametrize("policy", ["report", "fallback"])
def test_guard_acts_on_a_forced_alarm_and_clears(policy: str) -> None:
    cs = FakeCS()
    cs.update(1.0)
    g = DeltaGuard(0.1, 0.45, cs, policy)

    def decide() -> None:
        g.decide(0, lambda after: None, _no_ltt, FakeCS)

    decide()
    assert (g.lam, g.source, g.alarm) == (0.45, "bundle", False)
    cs.lower = 0.2  # the lower bound passes delta: alarm
    decide()
    assert g.alarm
    expected = {"report": (0.45, "bundle"), "fallback": (math.inf, "fallback")}[policy]
    assert (g.lam, g.source) == expected
    row = g.row()
    assert row["alarm"] is True and row["lambda_source"] == g.source
    assert (row["alarm_since"], row["alarm_lower"]) == (0, 0.2)
    cs.lower = 0.05  # the alarm goes, the guard stays until the upper bound says risk <= delta
    decide()
    assert not g.alarm and g.engaged and (g.lam, g.source) == expected
    cs.upper = 0.1
    decide()  # cleared: the bundle's lambda* returns
    assert (g.lam, g.source, g.engaged) == (0.45, "bundle", False)


def _recorded(first_score: float, hidden: int) -> OrcaResult:
    """A record-mode result of two steps whose first score is `first_score` (labels [0, 1] by
    FakeLabeller: the loss at lambda is 1 when first_score >= lambda)."""
    return orca_result(policy="shadow", scores=[first_score, 0.9], step_tokens=[3, 4],
                       lam=math.inf, step_embeddings=np.ones((2, hidden), dtype=np.float32))


def test_recalibrate_waits_for_audits_admitted_after_the_alarm(bundle) -> None:
    """On the alarm the guard falls back; LTT runs, at epsilon / 2, on the first `window`
    audits ADMITTED after the alarm (by admission order, not by the order they finish, and
    none from before) and on their recent half (`window_lambda`); the recalibrated lambda (not below the bundle's smallest lambda*) is
    then audited on its own, and its own alarm starts the second recalibration at epsilon / 6."""
    import asyncio

    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=0, on_alarm="recalibrate", window=3),
                      labeller=FakeLabeller(), cs_factory=FakeCS, loss=_loss)
    windows: list[tuple] = []

    def spy(scores, labels, delta, epsilon):
        windows.append((delta, epsilon, [round(float(s[0]), 3) for s in scores]))
        return 0.0  # more aggressive than any bundle lambda*: served at the floor
    audit.state._ltt = spy
    g, h = audit.state.guard(0.1), bundle.model.hidden_size

    def admit():
        return resolve({"messages": []}, OrcaDefaults(delta=0.1), bundle, thresholds=audit)[1]

    async def finish(settings, score: float | None) -> None:
        result = {0: None} if score is None else {0: _recorded(score, h)}
        audit.finished(settings, result, {0: "stop"})
        if audit._worker is not None:
            await audit._worker

    early = admit()  # admitted before the alarm, finishes after it
    asyncio.run(finish(admit(), 0.01))
    g.cs.lower = 0.5  # the next decision sees the alarm
    asyncio.run(finish(admit(), 0.02))
    assert (g.lam, g.source, g.waiting_since) == (math.inf, "fallback", 3)
    after = [admit() for _ in range(4)]  # admission numbers 4..7
    asyncio.run(finish(early, 0.03))
    for settings, score in zip(after[1:], (0.05, 0.06, 0.07)):
        asyncio.run(finish(settings, score))
    assert windows == [] and g.source == "fallback"  # waits for audit 4, admitted first
    asyncio.run(finish(after[0], None))  # it failed: skipped, and the window is complete
    floor = min(bundle.lam(d) for d in bundle.deltas())
    assert windows == [(0.1, 0.025, [0.05, 0.06, 0.07]), (0.1, 0.025, [0.06, 0.07])]
    assert (g.lam, g.source, g.recalibrations) == (floor, "audit", 1)
    row = g.row()["recalibrated"]
    assert (row["k"], row["epsilon"], row["lambda"], row["n"]) == (1, 0.025, floor, 0)

    late = admit()  # admitted after the recalibration: measures the served lambda
    asyncio.run(finish(late, floor + 0.01))
    assert g.served.cs.losses == [1] and windows[2:] == []  # once, on the window and its half
    g.served.cs.lower = 0.5  # its own alarm: the next audit starts the second wait
    asyncio.run(finish(admit(), 0.08))
    assert (g.source, g.waiting_since, g.served) == ("fallback", audit.state.admitted, None)
    for _ in range(3):
        asyncio.run(finish(admit(), 0.09))
    assert windows[2] == (0.1, 0.05 / 6, [0.09] * 3) and g.recalibrations == 2
    assert audit.state.guard(0.2).source == "bundle"  # another delta's guard never alarmed
    assert audit.state._resolved == {}  # nothing kept once no guard waits


def _finish(audit: LiveAudit, bundle, ends) -> None:
    """Requests at delta 0.1 admitted and ended one after another, each `(finish reasons,
    result)`, every audit's labelling awaited before the next ends."""
    import asyncio

    async def run() -> None:
        for reasons, result in ends:
            _, settings = resolve({"messages": []}, OrcaDefaults(delta=0.1), bundle,
                                  thresholds=audit)
            audit.finished(settings, {0: result}, reasons)
            if audit._worker is not None:
                await audit._worker

    asyncio.run(run())


def test_unfinished_audits_enter_the_risk_censored(bundle) -> None:
    """Cut by max_tokens or never finished: counted, labelled when there is a recording (as
    calibration labels a cut trajectory), and in the risk with their loss at a lambda that stops
    before where they ended, censored at one that would stop later (at 0 for the alarm; for
    the upper bound at the loss at the cut when cut, at 1 when aborted: cut_feed) and censored
    at every lambda without a recording."""
    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=0), labeller=FakeLabeller(),
                      cs_factory=FakeCS, loss=_loss)
    h = bundle.model.hidden_size
    assert 0.01 < bundle.lam(0.1) <= 0.5  # 0.5 stops at the first step, 0.01 at the last

    _finish(audit, bundle, [({0: "length"}, _recorded(0.5, h)), ({}, _recorded(0.5, h)),
                            ({0: "abort"}, _recorded(0.01, h)), ({0: "stop"}, _recorded(0.5, h)),
                            ({0: "length"}, _recorded(0.01, h)), ({}, None)])
    table = audit.table()
    assert (table["length"], table["aborted"], table["labelled"], table["failed"]) == (2, 3, 1, 0)
    cs = audit.state.guard(0.1).cs
    # stopped at the first step, before the cut (or the abort): loss known (labels [0, 1])
    assert cs.losses == [1, 1, None, 1, None, None] and cs.censored == 3
    # past the end: an aborted one at 1, a cut one at its loss at the cut (right there: 0)
    assert cs.worst == [None, None, 1.0, None, 0.0, 1.0]
    row = table["deltas"][[d["delta"] for d in table["deltas"]].index(0.1)]
    assert row["censored"] == 3 and row["n"] == 6
    assert table["attrition"]["length"] == pytest.approx(2 / 6)


def test_a_request_without_a_reasoning_step_is_left_out_not_failed(bundle) -> None:
    """Thinking off or a zero thinking budget: a recording with no step. Nothing to stop and no
    step to label (no calibration trace is like it): left out as `no_steps`, not counted as an
    engine failure (which operators read as one); cut, it is censored as any cut audit."""
    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=0), labeller=FakeLabeller(),
                      cs_factory=FakeCS, loss=_loss)
    h = bundle.model.hidden_size
    empty = orca_result(policy="shadow", scores=[], step_tokens=[], lam=math.inf,
                        step_embeddings=np.ones((0, h), dtype=np.float32))

    _finish(audit, bundle, [({0: "stop"}, empty), ({0: "stop"}, empty), ({0: "length"}, empty)])
    table = audit.table()
    assert (table["no_steps"], table["failed"], table["length"], table["labelled"]) == (2, 0, 1, 0)
    assert table["attrition"]["no_steps"] == pytest.approx(2 / 3)
    assert audit.state.guard(0.1).cs.losses == [None]  # the cut one, censored


def _drift_audit(bundle, seed: int):
    """A drift monitor (reference: uniform scores below 0.4) on an audit that samples nothing,
    the settings of one admitted request at delta 0.1, and the random stream that goes on."""
    rng = np.random.default_rng(seed)
    ref = build_reference([rng.uniform(0, 0.4, 6) for _ in range(300)], k=3,
                          lambdas=bundle_lams(bundle))
    drift = DriftMonitor(ref, window=50)
    audit = LiveAudit(bundle, AuditConfig(rate=0.0), drift=drift)
    _, settings = resolve({"messages": []}, OrcaDefaults(delta=0.1), bundle, thresholds=audit)
    return rng, drift, audit, settings


def test_drift_sees_one_choice_per_request(bundle) -> None:
    """n > 1 choices of one prompt share its difficulty: only choice 0 reaches the test."""
    _, drift, audit, settings = _drift_audit(bundle, seed=1)
    audit.finished(settings, {i: orca_result(scores=[0.1, 0.2], lam=math.inf)
                              for i in range(8)}, {i: "stop" for i in range(8)})
    assert drift.observed == 1


def test_fallback_reaches_requests_and_losses_use_the_bundle_lambda(bundle) -> None:
    """Losses that pass the lower bound switch delta 0.1 to never-stop for the next request,
    while every delta keeps measuring its bundle lambda* (audits run in shadow)."""
    made: list[FakeCS] = []

    def factory() -> FakeCS:
        made.append(FakeCS())
        return made[-1]

    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=0, on_alarm="fallback"),
                      cs_factory=factory, loss=_loss)
    lam = bundle.lam(0.1)
    scores = [lam + 0.01, 0.99]  # crosses the 0.1 lambda* at step 0, where the answer is wrong
    audit.observe(scores, [0, 1, 1])
    g = audit.state.guard(0.1)
    assert g.cs.losses == [1] and audit.state.guard(0.2).cs.losses == [1]
    g.cs.lower = 0.5
    audit.observe(scores, [0, 0, 1])
    body, settings = resolve({"messages": []}, OrcaDefaults(delta=0.1), bundle, thresholds=audit)
    assert body["vllm_xargs"]["orca_lam"] == "inf" and settings.lam_source == "fallback"
    obj = orca_object(settings, {0: orca_result()})
    assert obj["lambda"] is None and obj["lambda_source"] == "fallback"
    _, settings = resolve({"messages": [], "orca": {"delta": 0.2}}, OrcaDefaults(), bundle,
                          thresholds=audit)
    assert settings.lam == bundle.lam(0.2)
    audit.observe(scores, [0, 0, 0])  # never right: left out, as calibration leaves it out
    assert audit.counts["unsolvable"] == 1 and len(g.cs.losses) == 2
    table = audit.table()
    assert [r["delta"] for r in table["deltas"]] == bundle.deltas()
    assert json.dumps(table)  # the route's body


class FakeLabeller:
    """Labels every audit [0, 1] (our own fake of AuditLabeller: no engine)."""

    async def label(self, key: str, rec: dict, result: OrcaResult,
                    finish_reason: str | None, needs=None, give_up=None) -> dict:
        return {"id": key, "prompt": json.dumps(rec.get("messages")), "step_tokens": [3, 4],
                "labels": {"consistent": [0, 1]}, "extra": {"finish_reason": finish_reason}}


def test_audit_record_says_which_lambda_the_request_was_served(bundle, tmp_path: Path) -> None:
    """`extra.audit` keeps the scores unrounded, the lambda a request was admitted with and its
    source (bundle, then fallback after an alarm): what an offline replay needs to tell the served
    lambda's realized error from the bundle's."""
    import asyncio

    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=0, on_alarm="fallback"),
                      store=AuditStore(tmp_path, dim=bundle.model.hidden_size, info={"model": "m"}),
                      labeller=FakeLabeller(), cs_factory=FakeCS, loss=_loss)
    def result(lam: float) -> OrcaResult:
        return orca_result(policy="shadow", scores=[0.99999976, 0.2], step_tokens=[3, 4], lam=lam,
                           step_embeddings=np.ones((2, bundle.model.hidden_size),
                                                   dtype=np.float32))

    async def one(messages: list) -> None:
        _, settings = resolve({"messages": messages}, OrcaDefaults(delta=0.1), bundle,
                              thresholds=audit)
        audit.finished(settings, {0: result(settings.lam)}, {0: "stop"})
        await audit._worker

    asyncio.run(one([{"role": "user", "content": "a"}]))
    audit.state.guard(0.1).cs.lower = 0.5  # the next observation engages the guard
    audit.observe([0.5], [0, 1])
    asyncio.run(one([{"role": "user", "content": "b"}]))
    audit.store.close()
    rows = [p.extra["audit"] for p in TrajectorySet.open(tmp_path / "audit-000001").problems]
    assert rows[0]["lambda"] == bundle.lam(0.1) and rows[0]["lambda_source"] == "bundle"
    assert rows[1]["lambda"] is None and rows[1]["lambda_source"] == "fallback"
    # and which bundle's live audit took it: what audit-report counts it for (served_by)
    assert {r["bundle_checksum"] for r in rows} == {bundle.checksum}
    # the recorded scores give the server's stop decision at every lambda, 1.0 included: no stop
    # at step 0 (0.99999976 < 1), so no loss; rounded to 1.0 it would stop there, wrong
    assert request_loss(rows[0]["scores"], [0, 1], 1.0) == 0


def _one_shadow_audit(bundle, store: AuditStore) -> LiveAudit:
    """A live audit (rate 1) on `store` that took one finished shadow request; called in a
    running loop, where its labelling worker starts."""
    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=0), store=store,
                      labeller=FakeLabeller(), cs_factory=FakeCS, loss=_loss)
    result = orca_result(policy="shadow", scores=[0.2, 0.3], step_tokens=[3, 4], lam=0.5,
                         step_embeddings=np.ones((2, bundle.model.hidden_size), dtype=np.float32))
    _, settings = resolve({"messages": [{"role": "user", "content": "a"}]},
                          OrcaDefaults(delta=0.1), bundle, thresholds=audit)
    audit.finished(settings, {0: result}, {0: "stop"})
    return audit


def test_the_table_says_labelling_until_the_record_is_written(bundle, tmp_path: Path) -> None:
    """An audit's outcome enters the table before its record reaches the directory: `labelling`
    stays 1 until the record is written, so a reader of the directory (`audit-report`, a test)
    knows when to read it."""
    import asyncio
    import threading

    written = threading.Event()

    class SlowStore(AuditStore):
        def append(self, record, embeddings):
            assert written.wait(30)
            return super().append(record, embeddings)

    async def go() -> LiveAudit:
        audit = _one_shadow_audit(bundle, SlowStore(tmp_path, dim=bundle.model.hidden_size,
                                                    info={"model": "m"}))
        for _ in range(3000):
            if audit.table()["open"] == 0:
                break
            await asyncio.sleep(0.01)
        t = audit.table()
        assert (t["open"], t["queued"], t["labelling"], t["labelled"]) == (0, 0, 1, 1)
        assert audit.store.written == 0
        written.set()
        await audit._worker
        assert audit.table()["labelling"] == 0 and audit.store.written == 1
        return audit

    asyncio.run(go()).store.close()


def test_a_record_that_cannot_be_written_leaves_the_audit_in_the_risk(bundle,
                                                                     tmp_path: Path) -> None:
    """The directory's disk is full when a labelled audit's record is written: its outcome is
    journalled already, so the audit stays in the risk, once, and the table does not also count
    it as `failed` (the attrition of audits that did not enter the risk)."""
    import asyncio

    class FullStore(AuditStore):
        def append(self, record, embeddings):
            raise OSError(28, "No space left on device")

    async def go() -> LiveAudit:
        audit = _one_shadow_audit(bundle, FullStore(tmp_path, dim=bundle.model.hidden_size,
                                                    info={"model": "m"}))
        await audit._worker
        return audit

    audit = asyncio.run(go())
    t = audit.table()
    assert (t["picked"], t["labelled"], t["failed"], t["open"]) == (1, 1, 0, 0)
    assert t["attrition"]["failed"] == 0.0 and audit.state.guard(0.1).cs.n == 1
    audit.store.close()


def test_real_confidence_sequence_alarms_on_losses_and_metrics_show_it(bundle) -> None:
    """With the server's own confidence sequence and loss: audits that all stop before the answer
    is right at every bundle lambda* (score 1 at step 0, right only at the end) raise every
    delta's alarm within 40 audits, and the guard (fallback) then serves never-stop."""
    from prometheus_client import CollectorRegistry, generate_latest

    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=0, on_alarm="fallback"))
    for i in range(40):
        audit.observe([1.0, 1.0, 1.0], [0, 0, 0, 1])
    assert audit.counts["labelled"] == 40
    for row in audit.table()["deltas"]:
        assert row["n"] == 40 and row["risk"] == 1.0 and row["lower"] > row["delta"], row
        assert row["alarm"] and row["lambda"] is None and row["lambda_source"] == "fallback"
        assert row["alarm_since"] == 0 and row["alarm_lower"] == row["lower"]  # whole history
    reg = CollectorRegistry()
    reg.register(AuditCollector(lambda: audit, "toy"))
    text = generate_latest(reg).decode()
    assert 'orca_audit_requests_total{model_name="toy",state="labelled"} 40.0' in text
    assert 'orca_audit_alarm{delta="0.1",model_name="toy"} 1.0' in text
    assert 'orca_audit_lambda{delta="0.1",model_name="toy",source="fallback"} +Inf' in text
    assert "orca_drift_pvalue" not in text  # no drift monitor was given


def test_drift_monitor_sees_every_finished_request(bundle) -> None:
    """Scores of all requests (audited or not) reach the drift monitor; shifted ones alarm."""
    rng, drift, audit, settings = _drift_audit(bundle, seed=0)
    for _ in range(50):
        audit.finished(settings, {0: orca_result(scores=rng.uniform(0.6, 1.0, 5).tolist(),
                                                 lam=math.inf)}, {0: "stop"})
    assert drift.observed == 50 and drift.alarm
    assert audit.table()["drift"] == {"pvalue": drift.pvalue, "alarm": True}


def test_drift_pvalue_is_absent_before_the_first_test(bundle) -> None:
    """Before a window is full no test has run: no `orca_drift_pvalue` sample (1.0 would read
    as a test that passed) and `pvalue` null in the table; the alarm gauge reads 0."""
    from prometheus_client import CollectorRegistry, generate_latest

    rng, drift, audit, settings = _drift_audit(bundle, seed=2)
    reg = CollectorRegistry()
    reg.register(AuditCollector(lambda: audit, "toy"))

    def finish(n: int) -> str:
        for _ in range(n):
            audit.finished(settings, {0: orca_result(scores=rng.uniform(0, 0.4, 5).tolist(),
                                                     lam=math.inf)}, {0: "stop"})
        return generate_latest(reg).decode()

    text = finish(49)
    assert drift.tests == 0 and audit.table()["drift"] == {"pvalue": None, "alarm": False}
    assert "orca_drift_pvalue{" not in text and 'orca_drift_alarm{model_name="toy"} 0.0' in text
    text = finish(1)
    assert drift.tests == 1 and 0 <= drift.pvalue <= 1
    assert f'orca_drift_pvalue{{model_name="toy"}} {drift.pvalue!r}' in text


def bundle_lams(bundle) -> list[float]:
    return [bundle.lam(d) for d in bundle.deltas()]


# -- options ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--model", "m", "--orca-audit-rate", "0.5"], "needs --calib"),
    (["--demo", "--orca-audit-dir", "d"], "--orca-audit-rate is 0"),
    (["--demo", "--orca-audit-rate", "1.5"], "must be in [0, 1]"),
    (["--demo", "--orca-on-alarm", "panic"], "invalid choice"),
    # nothing is audited at rate 0, so no alarm can act (as --orca-audit-dir at rate 0)
    (["--demo", "--orca-on-alarm", "recalibrate"],
     "--orca-on-alarm recalibrate is set but --orca-audit-rate is 0"),
    (["--demo", "--orca-on-alarm", "fallback"], "--orca-audit-rate is 0"),
    (["--demo", "--orca-audit-drift-acts"], "--orca-audit-drift-acts is set but"),
    # redis-py would read a URL without a host as localhost
    (["--demo", "--orca-audit-rate", "0.5", "--orca-audit-store", "redis://"],
     "'redis://' names no server: give a host (redis://host:port/db)"),
    (["--demo", "--orca-audit-rate", "0.5", "--orca-audit-store", "rediss://:6379/0"],
     "names no server"),
    (["--demo", "--orca-audit-rate", "0.5", "--orca-audit-store", "unix://"],
     "names no server: give a socket path"),
    # a bad port surfaced after vLLM's import, named as --orca-audit-dir
    (["--demo", "--orca-audit-rate", "0.5", "--orca-audit-store", "redis://h:abc/0"],
     "--orca-audit-store 'redis://h:abc/0': Port could not be cast to integer value"),
    (["--demo", "--orca-audit-rate", "0.5", "--orca-audit-store", "redis://h:99999/0"],
     "Port out of range"),
    # the choices as the words to type, not the enum's reprs
    (["--demo", "--orca-policy", "bogus"],
     "invalid choice: 'bogus' (choose from 'answer', 'stop', 'shadow')"),
])
def test_bad_audit_options_end_in_one_line(argv, message, capsys) -> None:
    from orca_serve.startup.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and "<Policy" not in err, err


def test_the_help_group_every_error_points_to_lists_every_audit_option() -> None:
    """Errors say `orca-serve --help=orca-serve lists the orca options`: vLLM's --help=NAME
    prints the option group titled NAME, so every orca option must be in that group."""
    import argparse

    from orca_serve.startup.preflight import add_orca_args

    p = add_orca_args(argparse.ArgumentParser())
    # the group: its title, its description, a blank line, its options (up to the next blank)
    section = p.format_help().split("\norca-serve:\n")[1].split("\n\n")[1]
    audit = [o for a in p._actions for o in a.option_strings if o.startswith("--orca-audit")]
    assert len(audit) >= 10
    assert [o for o in audit if o not in section] == []
    assert "--orca-on-alarm" in section and "--orca-recalibrate-window" in section


# -- the store --------------------------------------------------------------------------------
def test_store_rotates_keeps_the_newest_and_resumes(tmp_path: Path) -> None:
    info = {"model": "m", "normalization": "token-l2", "source": "test"}
    store = AuditStore(tmp_path, dim=4, info=info, per_dir=2, keep=2)
    for i in range(5):
        store.append({"id": f"r{i}", "labels": {"consistent": [0, 1]}}, np.ones((2, 4)))
    store.close()
    dirs = [p.name for p in store.directories()]
    assert dirs == ["audit-000002", "audit-000003"]
    assert [p.id for p in TrajectorySet.open(tmp_path / "audit-000002").problems] == ["r2", "r3"]
    again = AuditStore(tmp_path, dim=4, info=info, per_dir=2, keep=2)
    assert again.current.name == "audit-000003"  # one audit in it: resumed
    again.append({"id": "r5", "labels": {"consistent": [1]}}, np.ones((1, 4)))
    again.close()
    assert len(TrajectorySet.open(tmp_path / "audit-000003")) == 2
    other = AuditStore(tmp_path, dim=8, info=info, per_dir=2, keep=2)  # another model
    assert other.current.name == "audit-000004"
    other.close()


@pytest.mark.parametrize("stray", ["file", "dangling link"])
def test_store_numbers_past_what_is_not_an_audit_directory(tmp_path: Path, stray: str) -> None:
    """An entry named like the next audit directory that is not one (a file, a link to a
    directory moved away) is numbered past. Before, the store tried that name for ever (its
    mkdir failed, FileExistsError, and the next try took the same number): measured, the
    constructor spun until killed, so a server hung at start, or in a hot reload's swap."""
    name = tmp_path / "audit-000001"
    if stray == "file":
        name.write_text("not an audit directory")
    else:
        name.symlink_to(tmp_path / "moved-away")
    opened: list[AuditStore] = []
    opening = threading.Thread(target=lambda: opened.append(
        AuditStore(tmp_path, dim=4, info={"model": "m"})), daemon=True)
    opening.start()
    opening.join(10)
    assert opened, "the store did not open within 10 s"
    assert opened[0].current.name == "audit-000002"
    opened[0].close()


def test_every_api_reports_how_a_request_finished() -> None:
    """The audit leaves out what was cut: chat's finish_reason, the Responses API's
    incomplete status and the Messages API's max_tokens stop all reach the bookkeeping as
    chat's terms (orca_serve/api_server/apis.py)."""
    import asyncio

    from orca_serve.api_server.apis import CHAT, MessagesApi, ResponsesApi

    class Req:
        def __init__(self) -> None:
            self.reasons: dict[int, str] = {}

        def note_finished(self, reasons: dict[int, str]) -> None:
            self.reasons.update(reasons)

        async def fetch_all(self) -> None:
            pass

        def orca(self, *a) -> dict:
            return {}

        def reasoning_spent(self) -> None:
            return None

    cases = [(CHAT, {"choices": [{"index": 0, "finish_reason": "length"},
                                 {"index": 1, "finish_reason": "stop"}]}, {0: "length", 1: "stop"}),
             (ResponsesApi(), {"object": "response", "status": "incomplete",
                               "incomplete_details": {"reason": "max_output_tokens"}},
              {0: "length"}),
             (ResponsesApi(), {"object": "response", "status": "completed"}, {0: "stop"}),
             (MessagesApi(), {"type": "message", "stop_reason": "max_tokens"}, {0: "length"}),
             (MessagesApi(), {"type": "message", "stop_reason": "end_turn"}, {0: "stop"})]
    for api, obj, expected in cases:
        req = Req()
        assert asyncio.run(api.on_json(obj, req)) and req.reasons == expected, (api, obj)


def test_a_recalibrated_lambda_is_not_trusted_while_its_drift_test_alarms(bundle) -> None:
    """After a recalibration the guard tests the live scores against the scores of the window
    LTT ran on: while the latest test alarms, that delta falls back (the traffic is no longer
    the one the lambda was certified on), and the lambda returns once a test passes again."""
    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=0, on_alarm="recalibrate", window=40),
                      cs_factory=FakeCS, loss=_loss)
    audit.state._ltt = lambda scores, labels, delta, epsilon: 0.95
    g = audit.state.guard(0.1)
    rng = np.random.default_rng(3)
    g.cs.lower = 0.5  # the bundle's alarm: wait for 40 audits admitted after it
    for _ in range(41):
        audit.observe(list(rng.uniform(0, 0.4, 6)), [0, 0, 0, 0, 1, 1])
    assert (g.source, g.lam, g.recalibrations) == ("audit", 0.95, 1)
    mon = g.served.drift
    assert mon is not None and mon.window == 20 and not mon.spend
    g.served.sequential = None  # the window test alone (the sequential one: the next test)
    for _ in range(20):  # like the window: trusted
        audit.see(list(rng.uniform(0, 0.4, 5)), math.inf)
    assert mon.tests == 1 and not g.distrusted and g.source == "audit"
    for _ in range(20):  # scores far above the window's
        audit.see(list(rng.uniform(0.6, 0.9, 5)), math.inf)
    assert g.distrusted and (g.source, g.lam) == ("fallback", math.inf)
    assert g.row()["distrusted"] and g.row()["recalibrated"]["drift"]["alarm"]
    for _ in range(20):
        audit.see(list(rng.uniform(0, 0.4, 5)), math.inf)
    assert not g.distrusted and (g.source, g.lam) == ("audit", 0.95)


def test_a_recalibrated_lambdas_sequential_drift_alarm_recalibrates_anew(bundle,
                                                                        tmp_path) -> None:
    """The sequential test against the recalibration window alarms within tens of requests of
    scores far above the window's; its alarm is journalled, and the guard answers it as its own
    alarm: fallback, then LTT on the first `window` audits admitted after it."""
    from orca_serve.live_audit.journal import Journal, journal_path

    path = journal_path(tmp_path, bundle.checksum)
    config = AuditConfig(rate=1.0, seed=0, on_alarm="recalibrate", window=40, drift_acts=True)
    audit = LiveAudit(bundle, config, journal=Journal(path, bundle.checksum, fsync=False),
                      loss=_loss)
    lams = {d: iter([0.95, 0.95, 0.9, 0.9]) for d in bundle.deltas()}  # window, recent half
    audit.state._ltt = lambda scores, labels, delta, epsilon: next(lams[delta])
    g = audit.state.guard(0.1)
    rng = np.random.default_rng(3)
    audit.state.drift_alarm()  # as if the bundle's sequential test alarmed: wait
    for _ in range(40):
        audit.observe(list(rng.uniform(0, 0.4, 6)), [0, 0, 0, 0, 1, 1])
    assert (g.source, g.lam, g.recalibrations) == ("audit", 0.95, 1)
    seq = g.served.sequential
    for i in range(60):  # like the window: no alarm
        audit.see(list(rng.uniform(0, 0.4, 5)), math.inf)
    assert not seq.alarm and g.source == "audit"
    for i in range(60):  # scores far above the window's
        audit.see(list(rng.uniform(0.6, 0.9, 5)), math.inf)
        if seq.alarm:
            break
    assert seq.alarm and seq.alarm_at - 60 < 30, seq.to_dict()
    assert (g.source, g.lam, g.waiting_since, g.served) == ("fallback", math.inf, 40, None)
    for _ in range(40):
        audit.observe(list(rng.uniform(0, 0.4, 6)), [0, 0, 0, 0, 1, 1])
    assert (g.source, g.lam, g.recalibrations) == ("audit", 0.9, 2)
    audit.state.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e for e in events if "x" in e] == [{"x": "drift", "d": None, "k": None}] + [
        {"x": "drift", "d": d, "k": 1} for d in bundle.deltas()]  # every delta's window moved


def test_the_bundles_sequential_drift_alarm_engages_fallback_until_later_audits_clear(
        bundle) -> None:
    """`fallback` with `--orca-audit-drift-acts`: the bundle's sequential drift alarm
    (journalled) makes the guard fall back although the audits so far are clean; it serves the
    bundle's lambda* again once the audits admitted after the alarm bound its risk at delta or
    below."""
    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=0, on_alarm="fallback", drift_acts=True),
                      loss=_loss)
    g = audit.state.guard(0.1)
    for _ in range(5):
        audit.observe([0.0, 0.0, 0.9], [0, 1, 1])  # never stops early: loss 0
    audit.state.drift_alarm()
    assert (g.engaged, g.source, g.lam, g.drift_since) == (True, "fallback", math.inf, 5)
    assert g.row()["drift_hold"]["n"] == 0
    n = 0
    while g.source == "fallback":
        audit.observe([0.0, 0.0, 0.9], [0, 1, 1])
        n += 1
    assert g.source == "bundle" and g.drift_cs is None and 10 < n < 200
    assert audit.state.guard(0.2).source == "bundle"  # every delta engaged, every one cleared


@pytest.mark.parametrize("acts", [False, True])
def test_the_bundles_sequential_drift_alarm_acts_only_with_the_operators_leave(bundle, tmp_path,
                                                                             acts) -> None:
    """Scores far above the calibration split's set the bundle's sequential drift test off
    within a few requests. It is journalled; by default it is reported (the table) and nothing
    else: it says the scores changed, not that the risk grew, and every delta keeps its
    lambda*. With `drift_acts` `fallback` engages every delta until later audits clear."""
    from orca_method.audit.martingale import ConformalMartingale
    from orca_serve.live_audit.journal import Journal, journal_path

    path = journal_path(tmp_path, bundle.checksum)
    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=0, on_alarm="fallback", drift_acts=acts),
                      journal=Journal(path, bundle.checksum, fsync=False),
                      sequential=ConformalMartingale(bundle.drift), loss=_loss)
    for _ in range(30):
        audit.see([0.99] * 5, math.inf)  # crosses every lambda at the first step
    table = audit.table()
    assert table["sequential_drift"]["alarm"] and table["sequential_drift"]["acts"] is acts
    assert table["sequential_drift"]["alarm_at"] < 15, table["sequential_drift"]
    for row in table["deltas"]:
        assert row["engaged"] is acts, row
        assert row["lambda_source"] == ("fallback" if acts else "bundle"), row
    audit.state.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e for e in events if "x" in e] == [{"x": "drift", "d": None, "k": None}]
    # a restart folds the journalled alarm by the settings it starts with
    again = LiveAudit(bundle, replace(audit.config, drift_acts=not acts),
                      journal=Journal(path, bundle.checksum, fsync=False), loss=_loss)
    assert [r["lambda_source"] for r in again.table()["deltas"]] == [
        "bundle" if acts else "fallback"] * len(bundle.deltas())
    again.state.close()


# -- the give-up risk ------------------------------------------------------------------------
GIVES_UP = [0.0, 0.0, 0.0]  # give-up scores at or below every mu* of the demo bundle at step 0
REASONS_ON = [0.9, 0.9, 0.9]  # above every mu*: never gives up


def _give_up_audit(bundle, **config) -> LiveAudit:
    return LiveAudit(bundle, AuditConfig(rate=0.0, seed=0, **config))


def test_a_give_up_alarm_turns_give_up_off_and_leaves_the_stop_threshold(bundle) -> None:
    """Audits that would all have given up at every mu* (and whose stop losses are 0): each give-up
    delta's lower bound passes its delta, and with the operator's leave (live audits label by
    consistency, not the give-up's reference labels) `fallback` turns give-up off for the next
    request: no mu* in its xargs, `give_up.source` fallback, inactive, while its lambda and every
    stop guard are untouched. The metrics and the table say the same."""
    from prometheus_client import CollectorRegistry, generate_latest

    audit = _give_up_audit(bundle, on_alarm="fallback", other_labels=True)
    for _ in range(40):
        audit.observe([0.0, 0.0, 0.0], [1, 1, 1], give_up=GIVES_UP)
    table = audit.table()
    assert table["give_up"]["guard_acts"] and table["give_up"]["loss"] == "gave_up"
    for row in table["give_up"]["deltas"]:
        assert row["n"] == 40 and row["risk"] == 1.0 and row["alarm"] and row["engaged"], row
        assert row["mu"] is None and row["mu_source"] == "fallback" and row["bundle_mu"] is not None
    for row in table["deltas"]:  # the stop side saw only loss 0
        assert row["risk"] == 0.0 and not row["alarm"] and row["lambda_source"] == "bundle", row
    request = {"messages": [], "orca": {"give_up": {"delta": 0.05}}}
    _, plain = resolve(request, OrcaDefaults(delta=0.1), bundle)
    assert plain.give_up_mu == bundle.mu(0.05)
    body, settings = resolve(request, OrcaDefaults(delta=0.1), bundle, thresholds=audit)
    assert "orca_give_up_mu" not in body["vllm_xargs"]
    assert body["vllm_xargs"]["orca_lam"] == bundle.lam(0.1) and settings.lam_source == "bundle"
    obj = orca_object(settings, {0: orca_result()})
    assert obj["give_up"] == {"delta": 0.05, "mu": None, "policy": "guess",
                              "source": "fallback", "active": False}
    assert obj["lambda"] == bundle.lam(0.1) and obj["lambda_source"] == "bundle"
    reg = CollectorRegistry()
    reg.register(AuditCollector(lambda: audit, "toy"))
    text = generate_latest(reg).decode()
    assert 'orca_audit_give_up_alarm{delta="0.05",model_name="toy"} 1.0' in text
    assert 'orca_audit_give_up_mu{delta="0.05",model_name="toy",source="fallback"} -Inf' in text
    assert 'orca_audit_lambda{delta="0.1",model_name="toy",source="bundle"}' in text


def test_a_give_up_alarm_only_reports_without_the_operators_leave(bundle) -> None:
    """Without --orca-guard-other-labels the give-up guard reports (the audit's loss is not the
    certified one: docs/AUDIT.md), so requests keep the bundle's mu*; under `report` too."""
    for config in ({"on_alarm": "fallback"}, {"on_alarm": "report", "other_labels": True}):
        audit = _give_up_audit(bundle, **config)
        for _ in range(40):
            audit.observe([0.0, 0.0, 0.0], [1, 1, 1], give_up=GIVES_UP)
        row = audit.table()["give_up"]["deltas"][1]
        assert row["alarm"] and row["mu_source"] == "bundle" and row["mu"] == bundle.mu(0.05)
        body, settings = resolve({"messages": [], "orca": {"give_up": {}}},
                                 OrcaDefaults(delta=0.1), bundle, thresholds=audit)
        assert body["vllm_xargs"]["orca_give_up_mu"] == bundle.mu(0.05)
        assert orca_object(settings, {0: orca_result()})["give_up"]["active"] is True


def test_give_up_risk_counts_never_right_and_censored_audits(bundle) -> None:
    """The give-up risk is over every request, as calibration's: a never-right audit (left out
    of the stop risk) enters with its loss; a cut one enters censored (loss 0 for the alarm, 1 for
    the upper bound); one without give-up scores is left out; the last step never gives up."""
    audit = _give_up_audit(bundle, on_alarm="fallback", other_labels=True)
    g = audit.state.give_up_guard(0.1)
    audit.observe([0.0, 0.0, 0.0], [0, 0, 0], give_up=GIVES_UP)  # never right: give-up loss 1
    assert audit.counts["unsolvable"] == 1 and audit.state.guard(0.1).cs.n == 0
    assert (g.cs.n, g.cs.mean) == (1, 1.0)
    audit.observe([0.0, 0.0, 0.0], [0, 1, 1], censored=True, give_up=GIVES_UP)
    assert (g.cs.n, g.cs.censored) == (2, 1)
    audit.observe([0.0, 0.0, 0.0], [0, 1, 1])  # no give-up scores: not in the give-up risk
    audit.observe([0.0, 0.0, 0.0], [0, 1, 1], give_up=[0.9, 0.9, 0.0])  # only the last step
    assert (g.cs.n, g.cs.mean) == (3, 0.5)


def test_give_up_guard_clears_only_when_the_upper_bound_is_back(bundle) -> None:
    """The stop guard's rule (`engagement`): engaged on an alarm, cleared when no member alarms
    AND the upper bound is at delta or below, not when the lower bound merely dips."""
    g = GiveUpGuard(0.05, bundle.mu(0.05), FakeCS(), on_alarm="fallback")
    g.cs.lower, g.cs.upper = 0.2, 0.6
    g.observe(GIVES_UP)
    assert g.engaged and (g.mu, g.source) == (-math.inf, "fallback")
    g.cs.lower = 0.0
    g.observe(REASONS_ON)
    assert g.engaged and g.source == "fallback"  # the lower bound dipped: still off
    g.cs.upper = 0.05
    g.observe(REASONS_ON)
    assert not g.engaged and (g.mu, g.source) == (bundle.mu(0.05), "bundle")
    assert g.cs.losses == [1, 0, 0]


def test_an_audit_is_scored_by_the_give_up_probe_it_never_ran(bundle) -> None:
    """Audits never give up, so the engine reports no give-up scores for them: the audit replays
    the bundle's give-up probe on the recorded step embeddings (calibration's replay), and each
    give-up guard measures the loss of those scores at its mu*."""
    import asyncio

    from orca_method.give_up import request_give_up_loss
    from orca_method.procedure import replay

    made: list[FakeCS] = []

    def factory() -> FakeCS:
        made.append(FakeCS())
        return made[-1]

    audit = LiveAudit(bundle, AuditConfig(rate=1.0, seed=0), labeller=FakeLabeller(),
                      cs_factory=factory, loss=_loss)
    h = bundle.model.hidden_size
    results = [_recorded(0.5, h), _recorded(0.5, h)]  # the first: embeddings of ones
    results[1] = replace(results[1], step_embeddings=np.random.default_rng(3).normal(
        size=(2, h)).astype(np.float32))

    async def run() -> None:
        for result in results:
            _, settings = resolve({"messages": []}, OrcaDefaults(delta=0.1), bundle,
                                  thresholds=audit)
            audit.finished(settings, {0: result}, {0: "stop"})
            await audit._worker

    asyncio.run(run())
    probe = bundle.load_give_up_probe()
    for d in bundle.give_up_deltas():
        expect = [request_give_up_loss(replay(probe, [r.step_embeddings],
                                              window=bundle.give_up.window)[0][1].numpy(),
                                       bundle.mu(d), None) for r in results]
        # the probe scores ones 0 at the first step (gives up at every mu*), the other 1
        assert audit.state.give_up_guard(d).cs.losses == expect == [1, 0]
    assert len(made) == len(bundle.deltas()) + len(bundle.give_up_deltas())
