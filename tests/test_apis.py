"""The Responses and Messages APIs, reasoning effort and vLLM's thinking budget in the middleware,
without an engine: a fake vLLM route per API (the shapes vLLM 0.32 writes) and a fake engine
client. The real server and clients are in tests/test_server_apis.py."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from prometheus_client import CollectorRegistry

from orca_method.probe import Probe, ProbeSpec
from orca_serve.api_server.apis import reasoning_spent, thinking_ended_by
from orca_serve.settings.effort import DEFAULT_EFFORT_MAP, parse_effort_map
from orca_serve.metrics.prometheus import OrcaMetrics
from orca_serve.api_server.middleware import OrcaMiddleware
from orca_serve.settings.field import OrcaRequestError
from orca_serve.settings.resolve import OrcaDefaults, resolve
from tests.bundles import tiny_bundle
from tests.servers import orca_result, orca_server

BUNDLE = tiny_bundle(Probe(ProbeSpec(dim=16), seed=0), [(0.05, 0.5), (0.1, None), (0.2, 0.9)],
                     default_delta=0.1)
DEFAULTS = OrcaDefaults(enabled=True, delta=0.1, policy="answer")
RESULT = orca_result(steps_scored=3, stopped_early=True, stop_step=3, would_stop_step=3,
                     last_score=0.75, reasoning_tokens=40, forced_tokens=[5, 6],
                     stop_reason="probe", reasoning_closed=True).to_dict()


class FakeEngine:
    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [{k: self.results[k] for k in args[0] if k in self.results}]


RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "output": [],
            "usage": {"input_tokens": 3, "output_tokens": 50, "total_tokens": 53,
                      "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0}}}
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
           "stop_reason": "end_turn", "usage": {"input_tokens": 3, "output_tokens": 50}}
RESPONSE_EVENTS = [("response.created", {"type": "response.created", "response": {
                        **RESPONSE, "status": "in_progress"}}),
                   ("response.output_text.delta", {"type": "response.output_text.delta",
                                                   "delta": "é"}),
                   ("response.completed", {"type": "response.completed", "response": RESPONSE})]
MESSAGE_EVENTS = [("message_start", {"type": "message_start", "message": MESSAGE}),
                  ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "text_delta", "text": "é"}}),
                  ("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": "end_turn"},
                                     "usage": {"input_tokens": 3, "output_tokens": 50}}),
                  ("message_stop", {"type": "message_stop"})]


def fake_vllm(engine: FakeEngine, seen: list):
    """vLLM's /v1/responses and /v1/messages as the middleware sees them: JSON, or SSE events
    with `event:` lines, split across body messages."""

    async def app(scope, receive, send):
        body = json.loads((await receive())["body"])
        seen.append(body)
        key = (body.get("vllm_xargs") or {}).get("orca_key")
        if key:
            engine.results[key] = dict(RESULT)
        messages = scope["path"] == "/v1/messages"
        if body.get("stream"):
            events = MESSAGE_EVENTS if messages else RESPONSE_EVENTS
            raw = "".join(f"event: {n}\ndata: {json.dumps(d, ensure_ascii=False)}\n\n"
                          for n, d in events).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            for i in range(0, len(raw), 5):
                await send({"type": "http.response.body", "body": raw[i:i + 5], "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        data = json.dumps(MESSAGE if messages else RESPONSE).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


def make_client(defaults: OrcaDefaults = DEFAULTS):
    engine, seen = FakeEngine(), []
    state = orca_server(BUNDLE, defaults, metrics=OrcaMetrics(CollectorRegistry()), engine=engine)
    app = OrcaMiddleware(fake_vllm(engine, seen), state)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t"), seen


def post(path: str, body: dict, defaults: OrcaDefaults = DEFAULTS) -> tuple[httpx.Response, list]:
    async def go():
        client, seen = make_client(defaults)
        r = await client.post(path, json={"model": "m", **body})
        await asyncio.sleep(0.01)  # the background fetch
        return r, seen
    return asyncio.run(go())


def sse(r: httpx.Response) -> list[tuple[str, dict]]:
    out = []
    for block in r.content.decode("utf-8").split("\n\n"):
        if block:
            name, data = block.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


# -- the two APIs ---------------------------------------------------------------------------------
def test_responses_json_gets_orca_and_reasoning_usage():
    r, seen = post("/v1/responses", {"input": "x", "orca": {"delta": 0.05, "policy": "stop"}})
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
    x = seen[0]["vllm_xargs"]
    assert "orca" not in seen[0] and x["orca_delta"] == 0.05 and x["orca_policy"] == "stop"
    body = r.json()
    o = body["orca"]
    assert o["stopped_early"] is True and o["lambda"] == 0.5 and o["delta_source"] == "request"
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 40,
                                                      "tool_output_tokens": 0}


def test_responses_stream_reports_on_the_closing_event_only():
    r, _ = post("/v1/responses", {"input": "x", "stream": True, "orca": {"delta": 0.05}})
    events = sse(r)
    assert [n for n, _ in events] == [n for n, _ in RESPONSE_EVENTS]
    assert events[1][1]["delta"] == "é"  # passed through (a split multi-byte character)
    assert "orca" not in events[0][1]["response"]
    done = events[-1][1]["response"]
    assert done["orca"]["stopped_early"] is True
    assert done["usage"]["output_tokens_details"]["reasoning_tokens"] == 40


def test_messages_json_and_stream_get_orca():
    r, seen = post("/v1/messages", {"max_tokens": 9, "messages": [], "orca": {"delta": 0.05}})
    assert seen[0]["vllm_xargs"]["orca_delta"] == 0.05
    body = r.json()
    assert body["orca"]["stopped_early"] is True
    assert body["usage"] == MESSAGE["usage"]  # Anthropic's usage has no reasoning count
    r, _ = post("/v1/messages", {"max_tokens": 9, "messages": [], "stream": True, "orca": {}})
    events = dict(sse(r))
    assert events["message_delta"]["orca"]["reasoning_tokens"] == 40
    assert "orca" not in events["message_start"]["message"]


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_malformed_orca_is_400_in_the_apis_error_shape(path):
    r, seen = post(path, {"orca": {"delta": 0.07}})
    assert r.status_code == 400 and not seen
    if path == "/v1/messages":
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert "available deltas: 0.05, 0.1, 0.2" in err["error"]["message"]
    else:
        err = r.json()["error"]
        assert err["param"] == "orca.delta" and err["code"] == 400


def test_background_response_with_orca_is_refused():
    r, seen = post("/v1/responses", {"input": "x", "background": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background" and not seen
    r, seen = post("/v1/responses", {"input": "x", "background": True, "orca": {"enabled": False}})
    assert r.status_code == 200 and seen[0]["vllm_xargs"]["orca_enabled"] == 0


def test_invalid_utf8_is_400_in_the_apis_error_shape():
    async def go(path):
        client, seen = make_client()
        return await client.post(path, content=b'{"model": "m\xff"}',
                                 headers={"content-type": "application/json"}), seen
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/embeddings"):
        r, seen = asyncio.run(go(path))
        assert r.status_code == 400 and not seen
        assert "not UTF-8" in r.json()["error"]["message"]
    r, _ = asyncio.run(go("/v1/messages"))
    assert r.status_code == 400 and "not UTF-8" in r.json()["error"]["message"]


# -- reasoning effort -----------------------------------------------------------------------------
@pytest.mark.parametrize("effort, delta", [("minimal", 0.2), ("low", 0.2), ("medium", 0.1),
                                           ("high", 0.05)])
def test_default_effort_table(effort, delta):
    _, s = resolve({"reasoning_effort": effort}, DEFAULTS, BUNDLE, effort=effort)
    assert (s.delta, s.delta_source, s.effort) == (delta, "effort", effort)
    assert s.lam == {0.05: 0.5, 0.1: math.inf, 0.2: 0.9}[delta]


def test_effort_off_disables_an_explicit_delta_wins_and_none_is_unmapped():
    for effort in ("xhigh", "max"):
        out, s = resolve({}, DEFAULTS, BUNDLE, effort=effort)
        assert s.enabled is False and out["vllm_xargs"]["orca_enabled"] == 0
    _, s = resolve({"orca": {"delta": 0.05}}, DEFAULTS, BUNDLE, effort="low")
    assert (s.delta, s.delta_source, s.effort) == (0.05, "request", None)
    _, s = resolve({"orca": {"enabled": True}}, DEFAULTS, BUNDLE, effort="max")
    assert s.enabled and s.delta == 0.1 and s.delta_source == "server"
    _, s = resolve({}, DEFAULTS, BUNDLE, effort="none")
    assert (s.delta, s.delta_source) == (0.1, "server")


def test_effort_map_option():
    table = parse_effort_map("low=0.05, high=off,max=default")
    assert table == {**DEFAULT_EFFORT_MAP, "low": 0.05, "high": "off", "max": "default"}
    for bad in ("low", "huge=0.1", "low=2", "low=lots"):
        with pytest.raises(ValueError, match="low|huge"):
            parse_effort_map(bad)
    d = OrcaDefaults(delta=0.1, effort_map=parse_effort_map("low=0.3"))
    with pytest.raises(OrcaRequestError) as e:  # a reload to a bundle without 0.3 is refused
        resolve({}, d, BUNDLE, effort="low")
    assert e.value.param == "reasoning_effort"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [], "reasoning_effort": "low"}),
    ("/v1/responses", {"input": "x", "reasoning": {"effort": "low"}}),
    ("/v1/messages", {"messages": [], "max_tokens": 9, "output_config": {"effort": "low"}}),
])
def test_each_api_carries_its_effort(path, body):
    if path == "/v1/chat/completions":  # the chat fake of test_requests answers chat bodies
        _, s = resolve(body, DEFAULTS, BUNDLE, effort="low")
        assert s.delta == 0.2
        return
    r, seen = post(path, body)
    assert seen[0]["vllm_xargs"]["orca_delta"] == 0.2
    o = r.json()["orca"] if not body.get("stream") else None
    assert o["delta"] == 0.2 and o["reasoning_effort"] == "low" and o["delta_source"] == "effort"


def test_thinking_budget_report():
    r, _ = post("/v1/messages", {"messages": [], "max_tokens": 9, "orca": {"delta": 0.05},
                                 "thinking": {"type": "enabled", "budget_tokens": 1024}})
    o = r.json()["orca"]
    assert o["thinking_token_budget"] == 1024 and o["thinking_ended_by"] == "orca"


@pytest.mark.parametrize("result, budget, by", [
    ({"stop_reason": "probe", "reasoning_closed": True, "reasoning_tokens": 9}, 10, "orca"),
    ({"stop_reason": "budget", "reasoning_closed": True}, None, "orca_answer_reserve"),
    # orca forced the end, though the reasoning closed like the model's own
    ({"stop_reason": "give_up", "reasoning_closed": True, "reasoning_tokens": 9}, None,
     "orca_give_up"),
    # vLLM's budget counts the reasoning tokens the prompt opened (here 1 after <think>)
    ({"reasoning_closed": True, "reasoning_tokens": 9, "prompt_reasoning_tokens": 1}, 10,
     "thinking_token_budget"),
    ({"reasoning_closed": True, "reasoning_tokens": 8, "prompt_reasoning_tokens": 1}, 10, "model"),
    ({"reasoning_closed": True, "reasoning_tokens": 8}, None, "model"),
    ({"reasoning_closed": False, "reasoning_tokens": 59}, 100, None),
])
def test_thinking_ended_by(result, budget, by):
    assert thinking_ended_by(orca_result(**result), budget) == by


def test_reasoning_spent_counts_the_unpooled_last_token():
    assert reasoning_spent(orca_result(reasoning_tokens=59, reasoning_closed=False)) == 60
    assert reasoning_spent(orca_result(reasoning_tokens=9, reasoning_closed=True)) == 9


def test_normal_shutdown_demotes_the_output_handlers_engine_dead_error():
    import logging
    import weakref

    from vllm.v1.engine.exceptions import EngineDeadError

    from orca_serve.api_server.quiet_shutdown import SHUTDOWN_TRIGGERED, ShutdownNoise, ShutdownSeen

    class Core:
        pass

    core = Core()
    core._finalizer = weakref.finalize(core, lambda: None)
    client = type("Client", (), {"engine_core": core})()
    trigger = ShutdownSeen()
    noise = ShutdownNoise(lambda: client, trigger)

    def record() -> logging.LogRecord:
        try:
            raise EngineDeadError()
        except EngineDeadError:
            import sys
            return logging.LogRecord("vllm.v1.engine.async_llm", logging.ERROR, "f", 1,
                                     "AsyncLLM output_handler failed.", (), sys.exc_info())

    crash = record()  # the engine died on its own: the traceback stays, at ERROR
    assert noise.filter(crash) and crash.levelno == logging.ERROR and crash.exc_info
    core._finalizer.detach()  # what vLLM's MPClient.shutdown does first
    quiet = record()
    assert noise.filter(quiet) and quiet.levelno == logging.INFO and quiet.exc_info is None
    assert "shut down" in quiet.getMessage()
    # a signal to the whole process group: the engine may die before the client shuts it down
    core2 = Core()
    core2._finalizer = weakref.finalize(core2, lambda: None)
    client.engine_core = core2
    assert noise.filter(r := record()) and r.levelno == logging.ERROR
    trigger.filter(logging.LogRecord("l", logging.INFO, "f", 1, SHUTDOWN_TRIGGERED, (), None))
    assert noise.filter(r := record()) and r.levelno == logging.INFO
