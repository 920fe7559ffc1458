"""The gate alarm in the engine-step core (orca_serve.core.gate_alarm), driven by the simulated
engine of tests/core_sim.py: fed at each request's gate step in the order requests were added (a
request not decided yet holds back later ones; one that leaves first gives its place up), one
decision per prompt, and, once raised, every later gated request served as a flagged one (also
one already past its gate), saying so in its result. The feed's statistics: test_gate_alarm."""

from __future__ import annotations

import random

import numpy as np
import pytest

from orca_method.bundle import gate_reference
from orca_method.gate_alarm import ArrivalFeed, GateAlarm
from orca_method.thresholds import NEVER
from orca_serve.settings.contract import (
    XARG_ALARM,
    XARG_GIVE_UP_MU,
    XARG_KEY,
    XARG_LAM,
    XARG_SHIFT_ALPHA,
    OrcaResult,
)
from orca_serve.settings.xargs import encode_lam
from tests.core_sim import (
    DIM,
    SimRequest,
    count_copies,
    gated_sim_bundle,
    make_core,
    run,
    to_device,
)

N_CAL = 39
FLAGGED = 1 / (N_CAL + 1)  # a p-value the gate flags at alpha 0.05


def typical_gate(hidden: int):
    """A shift gate whose calibration scores are far above any real step embedding's: it runs
    for every request and flags none (p = 1)."""
    rng = np.random.default_rng(0)
    far = np.zeros(hidden)
    far[0] = 100.0
    return gate_reference(rng.normal(size=(N_CAL + 1, hidden)),
                          far + rng.normal(size=(N_CAL, hidden)), steps=1, alpha=0.05, rank=4)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return gated_sim_bundle(tmp_path_factory.mktemp("typical") / "bundle.json", typical_gate(DIM))


def raise_alarm(alarm: GateAlarm) -> None:
    """Feed flagged decisions until the alarm is raised (what shifted traffic does)."""
    while not alarm.alarmed:
        alarm.observe(FLAGGED)


def _run(core, sims, **kw) -> dict[str, OrcaResult]:
    run(core, sims, **kw)
    raw = core.pop_results([s.name for s in sims])
    return {k: OrcaResult.from_wire(v) for k, v in raw.items()}


def _sims(requests: dict[str, dict], **kw) -> list[SimRequest]:
    rng = random.Random(0)
    return [SimRequest(name, rng, xa={XARG_KEY: name, **xa}, max_tokens=kw.get(name, 60),
                       join_at=i) for i, (name, xa) in enumerate(requests.items())]


def test_the_feed_keeps_the_arrival_order() -> None:
    """A later request that decides first waits for the earlier ones (None: no decision)."""
    feed = ArrivalFeed(GateAlarm(N_CAL, 0.05))
    first, second, third = feed.ticket(), feed.ticket(), feed.ticket()
    assert feed.decided(third, FLAGGED) == [] and feed.decided(second, FLAGGED) == []
    assert feed.alarm.seen == 0 and feed.waiting == 3
    feed.decided(first, None)
    assert (feed.alarm.seen, feed.alarm.flags, feed.waiting) == (2, 2, 0)


def test_one_decision_per_prompt_in_arrival_order(path) -> None:
    """The first request is preempted before its gate decides and stays away while the others
    decide: none of theirs is fed until it is back and decided. A request that ends before its
    gate gives its place up; one marked `orca_alarm` 0 takes none; nothing is left waiting."""
    core = make_core(path, max_num_seqs=8)
    feed = core.dep.alarm
    assert feed is not None and feed.alarm.level == 0.01  # the default level
    sims = _sims({"first": {}, "b": {}, "c": {}, "not-fed": {XARG_ALARM: 0}, "short": {}},
                 short=2)  # ends (max_tokens) before its first step completes
    first = sims[0]
    first.preempt_at = 1
    held: list[int] = []

    def on_step(t: int) -> None:
        if first.back_at is not None and first.back_at < 30:
            first.back_at = 30  # away long enough for every other request to decide
        if first.req is not None and first.req.shift_pvalue is None and t > 1:
            held.append(sum(s.req is not None and s.req.shift_pvalue is not None
                            for s in sims[1:]))
            assert feed.alarm.seen == 0  # the first request holds every later one back

    res = _run(core, sims, on_step=on_step)
    assert max(held) == 3  # b, c and not-fed decided while the first was away
    assert res["short"].shift_pvalue is None  # its gate never decided
    decided = [n for n in ("first", "b", "c") if res[n].shift_pvalue is not None]
    assert decided == ["first", "b", "c"] and res["not-fed"].shift_pvalue is not None
    assert (feed.alarm.seen, feed.alarm.flags, feed.waiting) == (3, 0, 0)
    assert core.get_stats()["alarms_raised"] == 0


def test_while_raised_a_request_is_served_as_a_flagged_one(path) -> None:
    """Raised: a gated request its own gate passes runs as a flagged one (`full`: no stop,
    no give-up) and says so; an audited (shadow) one and an ungated one are left alone."""
    now = {XARG_LAM: 0.0, XARG_GIVE_UP_MU: 0.2}  # would stop (or give up) at its first step
    requests = {"served": now, "shadow": {**now, "orca_policy": "shadow"},
                "ungated": {**now, XARG_SHIFT_ALPHA: 0}}
    calm = _run(make_core(path, defaults={"shift_action": "full"}), _sims(requests))
    assert calm["served"].ended != "full" and not calm["served"].shift_alarm
    core = make_core(path, defaults={"shift_action": "full"})
    raise_alarm(core.dep.alarm.alarm)
    res = _run(core, _sims(requests))
    r = res["served"]
    assert r.shift_alarm and not r.shift_flagged and r.shift_pvalue == 1.0
    assert not r.stopped_early and r.give_up_step is None and r.ended == "full"
    assert r.steps_scored > 1
    assert not res["shadow"].shift_alarm
    assert res["ungated"].shift_alpha is None and res["ungated"].steps_scored == 1
    assert core.get_stats()["alarms_raised"] == 1


def test_a_request_past_its_gate_switches_when_the_alarm_rises(path) -> None:
    """Its gate passed it, then the alarm rises: from its next step it runs the safe lambda
    (`full`: it stops no more), where its own lambda would have stopped it later."""
    ref = _run(make_core(path), _sims({"r": {XARG_LAM: encode_lam(NEVER)}}))["r"].scores
    k = next(k for k in range(3, len(ref) + 1) if ref[k - 1] > max(ref[:k - 1]))
    lam = {"r": {XARG_LAM: ref[k - 1]}}
    plain = _run(make_core(path, defaults={"shift_action": "full"}), _sims(lam))["r"]
    assert plain.stopped_early and plain.stop_step == k and not plain.shift_alarm
    core = make_core(path, defaults={"shift_action": "full"})
    sims = _sims(lam)

    def on_step(t: int) -> None:  # once its gate has decided (its first step read back)
        if sims[0].req is not None and sims[0].req.shift_pvalue is not None:
            raise_alarm(core.dep.alarm.alarm)

    r = _run(core, sims, on_step=on_step)["r"]
    assert r.shift_alarm and not r.shift_flagged and not r.stopped_early
    assert r.steps_scored > k


def test_the_alarm_costs_no_device_sync(path) -> None:
    """Fed, raised and applied from values the step reads back anyway: per step at most the
    one readback and the one staging copy (as tests/test_core.py checks for the core)."""
    core = make_core(path, max_num_seqs=4)
    to_device(core)
    sims = _sims({f"r{i}": {} for i in range(4)})
    per_step = count_copies(core)

    def on_step(t: int) -> None:
        if t == 6:
            raise_alarm(core.dep.alarm.alarm)

    res = _run(core, sims, on_step=on_step)
    assert any(r.shift_alarm for r in res.values()) and core.dep.alarm.alarm.seen >= 1
    for log in per_step:
        assert [e for e in log if e.startswith("d2h")] in ([], ["d2h copy_"]), log
        assert [e for e in log if e.startswith("h2d")] in ([], ["h2d copy_"]), log
