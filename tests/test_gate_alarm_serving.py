"""The gate alarm as the server reports it, without vLLM: the alarm lives in the engine core
(tests/test_core_gate_alarm.py), so the server resolves a request the same way whether it is
raised or not, reports `shift_alarm` from the engine's result, counts it, and reads the alarm's
state and changes from the engines' `orca_stats` (the real server: test_server_gate_alarm)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
from prometheus_client import CollectorRegistry, generate_latest

from orca_method.outcomes import Weighting
from orca_method.probe import Probe, ProbeSpec
from orca_serve.api_server.apis import APIS, CHAT_PATH
from orca_serve.api_server.middleware import OrcaMiddleware
from orca_serve.api_server.report import orca_object
from orca_serve.api_server.voting import sample_bodies
from orca_serve.metrics.prometheus import OrcaMetrics
from orca_serve.settings.contract import XARG_ALARM, VoteSettings
from orca_serve.settings.resolve import OrcaDefaults, resolve
from tests.bundles import far_gate, tiny_bundle
from tests.servers import orca_result, orca_server
from tests.test_requests import FakeEngine, fake_vllm

HIDDEN = 16
GATED = tiny_bundle(Probe(ProbeSpec(dim=HIDDEN), seed=0), [(0.05, 0.5), (0.2, 0.9)],
                    shift_gate=far_gate(HIDDEN))
DEFAULTS = OrcaDefaults(enabled=True, delta=0.05, policy="answer", answer_budget=None)


def test_the_report_says_what_the_engine_served() -> None:
    """`shift_alarm` at the top (any choice the alarm served) and per choice in `shift`."""
    _, s = resolve({"messages": [], "orca": {"delta": 0.05}}, DEFAULTS, GATED)
    assert s.lam == 0.5  # the server resolves as always: the engine applies the alarm
    gate = {"shift_alpha": 0.05, "shift_give_up_alpha": 0.05, "shift_pvalue": 1.0}
    served = orca_object(s, {0: orca_result(**gate, shift_alarm=True)})
    assert served["shift_alarm"] is True and served["shift"]["alarm"] is True
    assert served["shift"]["flagged"] is False  # what the gate alone decided
    calm = orca_object(s, {0: orca_result(**gate)})
    assert "shift_alarm" not in calm and calm["shift"]["alarm"] is False


def test_one_sample_of_a_vote_feeds_the_alarm() -> None:
    """Samples of one prompt are not independent draws: the first feeds the alarm, the others
    say `orca_alarm` 0."""
    _, s = resolve({"messages": [], "orca": {"delta": 0.05}}, DEFAULTS, GATED)
    vote = VoteSettings(k=3, t=None, delta_vote=0.1, weighting=Weighting.COUNT,
                        waves=(3,))
    bodies = sample_bodies({"messages": []}, replace(s, vote=vote), APIS[CHAT_PATH])
    xargs = [json.loads(b)["vllm_xargs"] for _, b in bodies]
    assert [x.get(XARG_ALARM, 1) for x in xargs] == [1, 0, 0]


class AlarmedEngine(FakeEngine):
    """The fake engine, its results served by a raised alarm and its stats saying so."""

    stats = {"alarms_raised": 1, "alarm_raised": 1, "alarm_cleared": 0}

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method == "orca_stats":
            return [{"probe_ns": 1, "engine_steps": 1, **self.stats}]
        for r in self.results.values():
            r.update(shift_alpha=0.05, shift_pvalue=1.0, shift_alarm=True)
        return await super().collective_rpc(method, timeout, args, kwargs)


def test_the_server_counts_served_requests_and_reads_the_state_from_the_engines() -> None:
    async def go():
        engine, seen = AlarmedEngine(), []
        state = orca_server(GATED, DEFAULTS, metrics=OrcaMetrics(CollectorRegistry()),
                            engine=engine)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(
            app=OrcaMiddleware(fake_vllm(engine, seen), state)), base_url="http://t")
        r = await client.post("/v1/chat/completions", json={"messages": []})
        assert r.json()["orca"]["shift_alarm"] is True
        assert seen[-1]["vllm_xargs"]["orca_lam"] == 0.5  # resolved as always
        for _ in range(100):  # the request is accounted after its response
            await asyncio.sleep(0.005)
            if state.metrics.shift_alarm_served._value.get():
                break
        await state.refresh_engine_stats()  # what a scrape of /metrics does first
        text = generate_latest(state.metrics.registry).decode()
        assert 'orca_shift_alarm_served_total{model_name=""} 1.0' in text
        assert 'orca_shift_alarm{model_name=""} 1.0' in text
        assert 'orca_shift_alarm_changes_total{change="raised",model_name=""} 1.0' in text
        engine.stats = {"alarms_raised": 0, "alarm_raised": 1, "alarm_cleared": 1}
        await state.refresh_engine_stats()
        text = generate_latest(state.metrics.registry).decode()
        assert 'orca_shift_alarm{model_name=""} 0.0' in text
        assert 'orca_shift_alarm_changes_total{change="cleared",model_name=""} 1.0' in text
    asyncio.run(go())
