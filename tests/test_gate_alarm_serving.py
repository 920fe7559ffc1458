"""The gate alarm in the server without vLLM: how a request is resolved while it is raised, the
feed in arrival order, and the middleware end to end against a fake engine whose results carry
gate p-values (the real server: tests/test_toy.py's gate-alarm test)."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry, generate_latest

from orca_method.gate_alarm import GateAlarm
from orca_method.probe import Probe, ProbeSpec
from orca_serve.api_server.gate_alarm import AlarmFeed, alarm_feed
from orca_serve.api_server.middleware import OrcaMiddleware
from orca_serve.api_server.report import orca_object
from orca_serve.metrics.prometheus import OrcaMetrics
from orca_serve.settings.contract import ShiftAction
from orca_serve.settings.resolve import OrcaDefaults, resolve
from tests.bundles import CAUTIOUS, far_gate, tiny_bundle, with_give_up, with_groups
from tests.servers import orca_server
from tests.test_requests import FakeEngine, fake_vllm

HIDDEN = 16
GATED = with_groups(
    with_give_up(tiny_bundle(Probe(ProbeSpec(dim=HIDDEN), seed=0),
                             [(0.05, 0.5), (0.1, None), (0.2, 0.9)],
                             shift_gate=far_gate(HIDDEN)), [(0.05, 0.6)], default_delta=0.05),
    {CAUTIOUS: {"lam": [(0.05, None), (0.1, None), (0.2, None)]}})
DEFAULTS = OrcaDefaults(enabled=True, delta=0.05, policy="answer", answer_budget=None)
N_CAL = len(GATED.shift_gate.scores)  # 39: p = 1 / 40 is flagged at alpha 0.05, 1 is not
FLAGGED, TYPICAL = 1 / (N_CAL + 1), 1.0


def test_while_raised_a_request_is_served_as_a_flagged_one_and_says_so() -> None:
    body = {"messages": [], "orca": {"delta": 0.05, "give_up": {"delta": 0.05}}}
    _, calm = resolve(body, DEFAULTS, GATED)
    assert calm.lam == 0.5 and calm.give_up_mu == 0.6 and not calm.shift_alarm
    out, s = resolve(body, DEFAULTS, GATED, shift_alarm=True)
    assert s.shift_alarm and s.lam == float("inf") and s.lam_source == "fallback"
    assert s.give_up_mu is None and s.give_up_source == "fallback"
    xargs = out["vllm_xargs"]
    assert "orca_give_up_mu" not in xargs and "orca_shift_alpha" not in xargs  # still gated
    o = orca_object(s, {})
    assert o["shift_alarm"] is True and o["lambda"] is None
    assert o["give_up"]["active"] is False
    # --orca-shift-action strict: the bundle's most conservative lambda*, still no give-up
    finite = with_give_up(tiny_bundle(Probe(ProbeSpec(dim=HIDDEN), seed=0),
                                      [(0.05, 0.5), (0.2, 0.9)], shift_gate=far_gate(HIDDEN)),
                          [(0.05, 0.6)], default_delta=0.05)
    _, strict = resolve(body, OrcaDefaults(**{**DEFAULTS.__dict__,
                                              "shift_action": ShiftAction.STRICT}),
                        finite, shift_alarm=True)
    assert strict.lam == 0.9 and strict.lam_source == "bundle" and strict.give_up_mu is None


def test_requests_the_gate_does_not_run_for_are_left_alone() -> None:
    for orca in ({"delta": 0.05, "shift_alpha": 0}, {"delta": 0.05, "group": CAUTIOUS}):
        _, s = resolve({"messages": [], "orca": orca}, DEFAULTS, GATED, shift_alarm=True)
        assert not s.shift_alarm and "shift_alarm" not in orca_object(s, {})
    _, off = resolve({"messages": [], "orca": {"enabled": False}}, DEFAULTS, GATED,
                     shift_alarm=True)
    assert not off.enabled and not off.shift_alarm


def test_an_alarm_only_where_a_gate_runs() -> None:
    assert alarm_feed(GATED, DEFAULTS) is not None
    assert alarm_feed(GATED, OrcaDefaults(**{**DEFAULTS.__dict__, "gate_alarm": 0})) is None
    assert alarm_feed(GATED, OrcaDefaults(**{**DEFAULTS.__dict__, "shift_alpha": 0})) is None
    assert alarm_feed(GATED, OrcaDefaults(**{**DEFAULTS.__dict__,
                                             "shift_action": ShiftAction.OFF})) is None
    plain = tiny_bundle(Probe(ProbeSpec(dim=HIDDEN), seed=0), [(0.05, 0.5)])
    assert alarm_feed(plain, DEFAULTS) is None
    feed = alarm_feed(GATED, OrcaDefaults(**{**DEFAULTS.__dict__, "shift_alpha": 0.1}))
    assert feed is not None and (feed.alarm.n_cal, feed.alarm.alpha) == (N_CAL, 0.1)


def test_the_alarm_is_fed_in_arrival_order() -> None:
    """A later request that finishes first waits for the earlier ones (None: no decision)."""
    feed = AlarmFeed(GateAlarm(N_CAL, 0.05))
    first, second, third = feed.ticket(), feed.ticket(), feed.ticket()
    feed.finished(third, FLAGGED)
    feed.finished(second, FLAGGED)
    assert feed.alarm.seen == 0
    feed.finished(first, None)
    assert (feed.alarm.seen, feed.alarm.flags) == (2, 2)


class GatedEngine(FakeEngine):
    """The fake engine, its results carrying the gate's decision: p = `pvalue`."""

    pvalue = FLAGGED

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        for r in self.results.values():
            r.update(shift_alpha=0.05, shift_pvalue=self.pvalue,
                     shift_flagged=self.pvalue <= 0.05)
        return await super().collective_rpc(method, timeout, args, kwargs)


def test_middleware_raises_serves_and_clears() -> None:
    """Flagged requests one after another raise the alarm within a handful; the next request is
    served as a flagged one and says so, and is counted; typical ones clear it again."""
    async def go():
        engine, seen = GatedEngine(), []
        state = orca_server(GATED, DEFAULTS, metrics=OrcaMetrics(CollectorRegistry()),
                            engine=engine)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(
            app=OrcaMiddleware(fake_vllm(engine, seen), state)), base_url="http://t")
        feed = state.serving.now.alarm

        async def one() -> dict:
            r = await client.post("/v1/chat/completions", json={"messages": []})
            for _ in range(100):  # the result is fetched and fed after the response
                await asyncio.sleep(0.005)
                if not feed.waiting:
                    break
            return r.json()["orca"]

        sent = 0
        while not feed.alarmed:
            o = await one()
            assert "shift_alarm" not in o and o["lambda"] == 0.5
            sent += 1
            assert sent <= 6
        o = await one()
        assert o["shift_alarm"] is True and o["lambda"] is None
        assert seen[-1]["vllm_xargs"]["orca_lam"] in ("inf", float("inf"))
        text = generate_latest(state.metrics.registry).decode()
        assert 'orca_shift_alarm{model_name=""} 1.0' in text
        assert 'orca_shift_alarm_served_total{model_name=""} 1.0' in text
        assert 'orca_shift_alarm_changes_total{change="raised",model_name=""} 1.0' in text
        engine.pvalue = TYPICAL
        for _ in range(400):
            await one()
            if not feed.alarmed:
                break
        assert not feed.alarmed
        assert "shift_alarm" not in await one()
        text = generate_latest(state.metrics.registry).decode()
        assert 'orca_shift_alarm{model_name=""} 0.0' in text
        assert 'orca_shift_alarm_changes_total{change="cleared",model_name=""} 1.0' in text
    asyncio.run(go())
