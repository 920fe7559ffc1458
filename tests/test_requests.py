"""Unit tests of the server side without an engine: the `orca` request field, the middleware
(body rewrite, JSON and SSE response shaping) against a fake vLLM app and a fake engine client,
the metrics, and the CLI's start-up refusals that happen before vLLM is imported."""

from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from orca_method.bundle import save_bundle
from orca_method.probe import Probe, ProbeSpec
from orca_serve.metrics.prometheus import OrcaMetrics, outcome_of
from orca_serve.api_server.middleware import OrcaMiddleware
from orca_serve.settings.field import OrcaRequestError
from orca_serve.api_server.report import ResultFetcher, orca_object
from orca_serve.settings.resolve import OrcaDefaults, resolve
from tests.bundles import tiny_bundle
from tests.servers import orca_result, orca_server

HIDDEN = 16


BUNDLE = tiny_bundle(Probe(ProbeSpec(dim=HIDDEN), seed=0), [(0.05, 0.5), (0.1, None), (0.2, 0.9)])
DEFAULTS = OrcaDefaults(enabled=True, delta=0.05, policy="answer", answer_budget=None)


# -- resolve -----------------------------------------------------------------------------------
def test_defaults_fill_vllm_xargs_and_remove_orca():
    body = {"model": "m", "messages": [], "orca": {}, "vllm_xargs": {"other": 3}}
    out, s = resolve(body, DEFAULTS, BUNDLE)
    assert "orca" not in out and "orca" in body  # input untouched
    x = out["vllm_xargs"]
    assert x["other"] == 3
    assert x["orca_enabled"] == 1 and x["orca_delta"] == 0.05 and x["orca_policy"] == "answer"
    assert "orca_answer_budget" not in x
    assert x["orca_key"].startswith("orca-") and x["orca_key"] == s.key
    assert s.lam == 0.5 and s.n == 1


def test_request_without_orca_gets_defaults_and_unique_keys():
    out1, s1 = resolve({"prompt": "x"}, DEFAULTS, BUNDLE, completions=True)
    _out2, s2 = resolve({"prompt": "x"}, DEFAULTS, BUNDLE, completions=True)
    assert s1.enabled and s1.key != s2.key
    assert all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
               for v in out1["vllm_xargs"].values())


def test_orca_field_settings():
    out, s = resolve({"orca": {"delta": 0.1, "policy": "shadow", "enabled": True,
                               "answer_budget": 64}, "n": 3}, DEFAULTS, BUNDLE)
    assert (s.delta, s.policy, s.lam, s.answer_budget, s.n) == (0.1, "shadow", math.inf, 64, 3)
    assert out["vllm_xargs"]["orca_answer_budget"] == 64
    assert out["vllm_xargs"]["orca_policy"] == "shadow"


def test_vllm_xargs_spelling():
    _out, s = resolve({"vllm_xargs": {"orca_delta": 0.2, "orca_policy": "stop", "orca_enabled": 1,
                                     "orca_answer_budget": 0}}, DEFAULTS, BUNDLE)
    assert (s.delta, s.policy, s.lam, s.answer_budget) == (0.2, "stop", 0.9, 0)


def test_disabled():
    for body in ({"orca": {"enabled": False}}, {"vllm_xargs": {"orca_enabled": 0}}):
        out, s = resolve(body, DEFAULTS, BUNDLE)
        assert not s.enabled
        assert out["vllm_xargs"]["orca_enabled"] == 0
        assert "orca_delta" not in out["vllm_xargs"]
        assert orca_object(s, {}) == {"enabled": False}


def test_integer_delta_is_a_number_but_strings_and_bools_are_not():
    with pytest.raises(OrcaRequestError):
        resolve({"orca": {"delta": "0.05"}}, DEFAULTS, BUNDLE)
    with pytest.raises(OrcaRequestError):
        resolve({"orca": {"enabled": 1}}, DEFAULTS, BUNDLE)  # orca.enabled is a JSON bool


@pytest.mark.parametrize("body, param, words", [
    ({"orca": {"delta": 0.05, "colour": 1}}, "orca.colour", ["unknown field"]),
    ({"orca": {"policy": "maybe"}}, "orca.policy", ["answer", "stop", "shadow"]),
    ({"orca": {"answer_budget": -1}}, "orca.answer_budget", ["an integer in [0, "]),
    ({"orca": {"answer_budget": 1.5}}, "orca.answer_budget", ["integer"]),
    # beyond vLLM's extra_args integer range: our 400 names the field the client sent
    ({"orca": {"answer_budget": 2**64}}, "orca.answer_budget", ["an integer in [0, "]),
    ({"vllm_xargs": {"orca_answer_budget": 2**64}}, "vllm_xargs.orca_answer_budget",
     ["an integer in [0, "]),
    ({"orca": {"delta": 1.5}}, "orca.delta", ["a number in (0, 1)"]),
    ({"orca": {"enabled": "yes"}}, "orca.enabled", ["true or false"]),
    ({"orca": "on"}, "orca", ["object"]),
    ({"orca": [1]}, "orca", ["object"]),
    ({"vllm_xargs": {"orca_colour": 1}}, "vllm_xargs.orca_colour", ["unknown"]),
    ({"vllm_xargs": {"orca_key": "mine"}}, "vllm_xargs.orca_key", ["set by the server"]),
    ({"vllm_xargs": {"orca_enabled": 2}}, "vllm_xargs.orca_enabled", ["0 or 1"]),
    ({"vllm_xargs": {"orca_policy": "x"}}, "vllm_xargs.orca_policy", ["answer"]),
    ({"vllm_xargs": {"orca_answer_budget": -3}}, "vllm_xargs.orca_answer_budget",
     ["an integer in [0, "]),
    ({"orca": {"delta": 0.1}, "vllm_xargs": {"orca_delta": 0.1}}, "orca.delta", ["both"]),
])
def test_malformed(body, param, words):
    with pytest.raises(OrcaRequestError) as e:
        resolve(body, DEFAULTS, BUNDLE)
    assert e.value.param == param
    assert any(w in e.value.message for w in words), e.value.message


def test_delta_without_lambda_lists_available_deltas():
    with pytest.raises(OrcaRequestError) as e:
        resolve({"orca": {"delta": 0.07}}, DEFAULTS, BUNDLE)
    assert "0.05, 0.1, 0.2" in e.value.message and e.value.param == "orca.delta"


def test_batched_prompts_refused_when_enabled():
    with pytest.raises(OrcaRequestError) as e:
        resolve({"prompt": ["a", "b"]}, DEFAULTS, BUNDLE, completions=True)
    assert e.value.param == "prompt"
    resolve({"prompt": ["a"]}, DEFAULTS, BUNDLE, completions=True)
    resolve({"prompt": [1, 2, 3]}, DEFAULTS, BUNDLE, completions=True)  # one prompt of ids
    resolve({"prompt": ["a", "b"], "orca": {"enabled": False}}, DEFAULTS, BUNDLE, completions=True)


def test_without_bundle_requests_pass_untouched_and_orca_is_refused():
    body = {"messages": [], "vllm_xargs": {"x": 1}}
    out, s = resolve(body, OrcaDefaults(enabled=False), None)
    assert out is body and s is None
    out, s = resolve({"orca": {"enabled": False}, "vllm_xargs": {"y": 1}},
                     OrcaDefaults(enabled=False), None)
    assert s is None and "orca" not in out and out["vllm_xargs"] == {"y": 1}
    out, s = resolve({"vllm_xargs": {"orca_enabled": 0}}, OrcaDefaults(enabled=False), None)
    assert s is None and "vllm_xargs" not in out
    with pytest.raises(OrcaRequestError) as e:
        resolve({"orca": {"delta": 0.05}}, OrcaDefaults(enabled=False), None)
    assert "--calib" in e.value.message


# -- middleware against a fake vLLM ------------------------------------------------------------
class FakeEngine:
    """Answers orca_results like the plugin: results keyed by orca_key, one dict per worker."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}
        self.calls: list[tuple] = []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, args))
        await asyncio.sleep(0.001)
        if method == "orca_stats":
            return [{"probe_ns": 2_000_000, "engine_steps": 4}]
        keys = args[0]
        return [{k: self.results[k] for k in keys if k in self.results}]


def fake_vllm(engine: FakeEngine, seen: list):
    """A stand-in for vLLM's route: echoes the xargs and registers a plugin result."""

    async def app(scope, receive, send):
        msg = await receive()
        body = json.loads(msg["body"])
        seen.append(body)
        key = (body.get("vllm_xargs") or {}).get("orca_key")
        if key:
            engine.results[key] = {"enabled": True, "policy": body["vllm_xargs"]["orca_policy"],
                                   "delta": 0.05, "lam": 0.5, "steps_scored": 3,
                                   "stopped_early": True, "stop_step": 3, "would_stop_step": 3,
                                   "last_score": 0.75, "scores": [0.1, 0.5, 0.75],
                                   "reasoning_tokens": 40, "forced_tokens": [5, 6, 7, 8],
                                   "stop_reason": "probe", "index": 0,
                                   "reasoning_closed": True}
        if body.get("stream"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            chunks = [{"id": "c", "choices": [{"index": 0, "delta": {"content": "a"},
                                               "finish_reason": None}]},
                      {"id": "c", "choices": [{"index": 0, "delta": {"content": "é"},
                                               "finish_reason": "stop"}]}]
            if (body.get("stream_options") or {}).get("include_usage"):
                chunks.append({"id": "c", "choices": [], "usage": {"total_tokens": 5}})
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            raw = text.encode()
            for i in range(0, len(raw), 7):  # split events across body messages on purpose
                await send({"type": "http.response.body", "body": raw[i:i + 7],
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        data = json.dumps({"id": "c", "choices": [{"index": 0, "message": {"content": "hi"},
                                                   "finish_reason": "stop"}],
                           "usage": {"total_tokens": 5}}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


def make_client(bundle=BUNDLE, defaults=DEFAULTS):
    engine, seen = FakeEngine(), []
    state = orca_server(bundle, defaults, metrics=OrcaMetrics(CollectorRegistry()), engine=engine)
    app = OrcaMiddleware(fake_vllm(engine, seen), state)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return client, engine, seen, state


def run(coro):
    return asyncio.run(coro)


def test_middleware_json_response_gets_orca():
    async def go():
        client, _engine, seen, state = make_client()
        r = await client.post("/v1/chat/completions", json={"messages": [], "orca": {"delta": 0.05}})
        assert r.status_code == 200
        body = r.json()
        assert int(r.headers["content-length"]) == len(r.content)
        assert seen[0]["vllm_xargs"]["orca_key"].startswith("orca-") and "orca" not in seen[0]
        o = body["orca"]
        assert o == {"enabled": True, "policy": "answer", "delta": 0.05,
                     "delta_source": "request", "lambda": 0.5,
                     "lambda_source": "bundle", "bundle_checksum": BUNDLE.checksum,
                     "steps_scored": 3, "stopped_early": True, "stop_step": 3,
                     "would_stop_step": 3, "last_score": 0.75, "reasoning_tokens": 40,
                     "forced_tokens": 4, "stop_reason": "probe", "ended": "early",
                     "thinking_ended_by": "orca"}
        # usage counts the reasoning tokens the engine generated (the plugin's count)
        assert body["usage"] == {"total_tokens": 5,
                                 "completion_tokens_details": {"reasoning_tokens": 40}}
        await asyncio.sleep(0.05)
        text = generate_latest(state.metrics.registry).decode()
        assert 'orca_requests_total{model_name="",outcome="stopped_early"} 1.0' in text
        assert 'orca_steps_scored_total{model_name=""} 3.0' in text
    run(go())


def test_middleware_400_in_openai_format():
    async def go():
        client, _engine, seen, _ = make_client()
        r = await client.post("/v1/chat/completions", json={"orca": {"delta": 0.3}})
        assert r.status_code == 400 and not seen
        err = r.json()["error"]
        assert err["code"] == 400 and err["type"] == "BadRequestError"
        assert err["param"] == "orca.delta" and "0.05, 0.1, 0.2" in err["message"]
        r = await client.post("/v1/completions", json={"orca": {"policy": 3}})
        assert r.status_code == 400
    run(go())


def test_errors_of_messages_routes_are_reshaped_as_anthropics():
    """An error a vLLM route writes in OpenAI's shape (its request validation) leaves a
    /v1/messages route in Anthropic's, with Anthropic's type for the status; other routes and
    successful responses are untouched."""
    openai_shaped = {"error": {"message": "budget_tokens: should be >= 1024",
                               "type": "Bad Request", "param": "body.thinking", "code": 400}}

    async def vllm(scope, receive, send):
        await receive()
        status = {"/v1/messages": 400, "/v1/messages/count_tokens": 404}.get(scope["path"], 400)
        body = json.dumps(openai_shaped).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body[:9], "more_body": True})
        await send({"type": "http.response.body", "body": body[9:]})

    state = orca_server(None, DEFAULTS, metrics=OrcaMetrics(CollectorRegistry()),
                        engine=FakeEngine())
    app = OrcaMiddleware(vllm, state)

    async def go():
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        for path, status, kind in (("/v1/messages", 400, "invalid_request_error"),
                                   ("/v1/messages/count_tokens", 404, "not_found_error")):
            r = await client.post(path, json={"model": "m"})
            assert r.status_code == status and int(r.headers["content-length"]) == len(r.content)
            assert r.json() == {"type": "error", "error": {
                "type": kind, "message": "budget_tokens: should be >= 1024"}}
        r = await client.post("/v1/chat/completions", json={"model": "m"})
        assert r.json() == openai_shaped
    run(go())


def test_client_errors_logged_by_vllms_handlers_are_one_warning_line():
    """A record with a traceback from vLLM's API loggers, inside a request's scope, waits for
    the response's status: a 4xx makes it one WARNING line, a 5xx (or no response) leaves it
    as it was; outside a scope, and from other loggers, nothing waits."""
    import logging

    from orca_serve.api_server.log import ErrorsByStatus, deferred_errors, release

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Collect()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.addFilter(ErrorsByStatus())
    api = logging.getLogger("vllm.entrypoints.orca_test")
    api.addHandler(handler)
    api.propagate = False

    def fail(logger: logging.Logger = api) -> None:
        try:
            raise ValueError("max_tokens too big")
        except ValueError:
            logger.exception("Error in create_messages: %s", "max_tokens too big")

    try:
        for status, want in ((400, ["WARNING Error in create_messages: max_tokens too big"]),
                             (500, None)):
            lines.clear()
            with deferred_errors() as held:
                fail()
                assert lines == [] and len(held) == 1
                release(held, status)
            if want is not None:
                assert lines == want
            else:
                assert len(lines) == 1 and "Traceback" in lines[0] and lines[0].startswith("ERROR")
        lines.clear()
        with deferred_errors():
            fail()  # no response started: logged as it was when the scope ends
        assert len(lines) == 1 and "Traceback" in lines[0]
        lines.clear()
        fail()  # outside a request's scope
        assert len(lines) == 1 and "Traceback" in lines[0]
    finally:
        api.removeHandler(handler)


BIG = "9" * 1_000_000  # a 1 MB value (the trial's): the 400 quotes its start and its length


@pytest.mark.parametrize("body", [
    {"orca": {"delta": BIG}}, {"orca": {"policy": BIG}}, {"orca": {BIG: 1}},
    {"vllm_xargs": {"orca_delta": BIG}}, {"vllm_xargs": {"orca_enabled": BIG}},
    {"vllm_xargs": {"orca_" + BIG: 1}}])
def test_a_400_never_echoes_a_value_whole(body):
    async def go():
        client, _engine, seen, _ = make_client()
        r = await client.post("/v1/chat/completions", json={"messages": [], **body})
        assert r.status_code == 400 and not seen
        err = r.json()["error"]
        assert len(r.content) < 1000, err["message"][:300]
        assert "characters)" in err["message"] or "characters)" in (err["param"] or "")
    run(go())


def test_engine_side_xarg_checks_cut_what_they_quote():
    from orca_serve.settings.xargs import validate_xargs

    for xa in ({"orca_delta": BIG}, {"orca_policy": BIG}, {"orca_lam": "x" + BIG},
               {"orca_key": [1] * 10**5}):
        with pytest.raises(ValueError) as e:
            validate_xargs(xa)
        assert len(str(e.value)) < 300 and "characters)" in str(e.value)


@pytest.mark.parametrize("usage", [False, True])
def test_middleware_stream_finish_chunk_and_usage_chunk(usage):
    async def go():
        client, _engine, _seen, _ = make_client()
        body = {"stream": True, "orca": {"policy": "shadow"}}
        if usage:
            body["stream_options"] = {"include_usage": True}
        r = await client.post("/v1/chat/completions", json=body)
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert "orca" not in chunks[0]
        assert chunks[1]["orca"]["policy"] == "shadow" and chunks[1]["orca"]["steps_scored"] == 3
        assert chunks[1]["choices"][0]["delta"]["content"] == "é"
        if usage:
            assert chunks[2]["orca"] == chunks[1]["orca"]
    run(go())


class OnceEngine(FakeEngine):
    """Hands each result out once, as the plugin does, `delay` seconds after it was asked."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay, self.asked = delay, asyncio.Event()

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method != "orca_results":
            return await super().collective_rpc(method, timeout, args, kwargs)
        self.asked.set()
        await asyncio.sleep(self.delay)
        return [{k: self.results.pop(k) for k in args[0] if k in self.results}]


def test_a_client_gone_while_its_finishing_chunk_waits_for_the_result_is_still_counted():
    """The client disconnects while the stream's finishing chunk waits for the result, and the
    stream is cancelled (Starlette cancels it on a disconnect). The result the engine handed
    out is kept and counted: before, it was dropped and the request went uncounted (the soak
    test: 24 of 300 streams closed at their last token; a live audit of one "failed")."""
    async def go():
        engine, seen = OnceEngine(delay=0.05), []
        state = orca_server(BUNDLE, DEFAULTS, metrics=OrcaMetrics(CollectorRegistry()),
                            engine=engine)
        app = OrcaMiddleware(fake_vllm(engine, seen), state)
        body = json.dumps({"stream": True, "orca": {"policy": "shadow"}}).encode()
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [(b"content-type", b"application/json")]}

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(msg):
            pass

        stream = asyncio.ensure_future(app(scope, receive, send))
        await engine.asked.wait()  # the finishing chunk waits for its result
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stream
        await asyncio.sleep(0.2)  # the fetch and the accounting after the disconnect
        text = generate_latest(state.metrics.registry).decode()
        assert 'orca_requests_total{model_name="",outcome="shadow_would_stop"} 1.0' in text
    run(go())


def test_middleware_passes_other_routes_and_plain_bodies():
    async def go():
        client, _engine, seen, _ = make_client(bundle=None, defaults=OrcaDefaults(enabled=False))
        r = await client.post("/v1/chat/completions", json={"messages": []})
        assert "orca" not in r.json() and seen[0] == {"messages": []}
        r = await client.post("/v1/chat/completions", json={"orca": {"delta": 0.05}})
        assert r.status_code == 400
        r = await client.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 200 and seen[-1] == {"input": "x"}  # not ours: passed on as is
    run(go())


def test_fetcher_batches_concurrent_requests():
    async def go():
        engine = FakeEngine()
        engine.results = {f"k{i}": orca_result(steps_scored=i).to_dict() for i in range(64)}

        async def rpc(method, args=()):
            return await engine.collective_rpc(method, args=args)

        f = ResultFetcher(rpc)
        got = await asyncio.gather(*[f.get([f"k{i}"]) for i in range(64)])
        assert [g[f"k{i}"].steps_scored for i, g in enumerate(got)] == list(range(64))
        assert len(engine.calls) <= 3
    run(go())


def test_metrics_outcomes_and_engine_stats():
    m = OrcaMetrics(CollectorRegistry())
    m.observe(None)
    m.observe(orca_result(policy="shadow", would_stop_step=2, steps_scored=5, last_score=0.4,
                          reasoning_tokens=30))
    m.observe(orca_result(policy="shadow", would_stop_step=1, steps_scored=4, last_score=0.4,
                          reasoning_tokens=40))
    m.observe(orca_result(steps_scored=2, last_score=0.1, reasoning_tokens=10))
    m.update_engine_stats([{"probe_ns": 3_000_000, "engine_steps": 6, "stored_results": 2}])
    text = re.sub(r'\{model_name=""\}|,?model_name=""', "", generate_latest(m.registry).decode())
    text = text.replace("{,", "{")
    for line in ['orca_requests_total{outcome="disabled"} 1.0',
                 'orca_requests_total{outcome="shadow_would_stop"} 2.0',
                 'orca_requests_total{outcome="finished"} 1.0',
                 "orca_steps_scored_total 11.0", "orca_reasoning_tokens_total 80.0",
                 'orca_tokens_saved_total{basis="step_fraction"} 48.0',  # 30*3/5 + 40*3/4
                 'orca_stop_step_count{kind="shadow"} 2.0', "orca_last_score_count 3.0",
                 "orca_probe_seconds_total 0.003", "orca_engine_steps_total 6.0",
                 "orca_engine_stored_results 2.0", "orca_engine_tracked_requests 0.0"]:
        assert line in text, line
    assert outcome_of(orca_result(policy="stop", stopped_early=True)) == "stopped_early"
    assert outcome_of(orca_result(stop_reason="budget")) == "answer_forced_at_budget"
    assert outcome_of(orca_result(error="x", enabled=False)) == "error"


# -- CLI refusals before vLLM is imported ------------------------------------------------------
def test_cli_refuses_corrupt_bundle_and_unknown_delta(tmp_path, capsys):
    from orca_serve.startup.cli import main

    p = tmp_path / "b.json"
    save_bundle(BUNDLE, p)
    data = json.loads(p.read_text())
    data["default_delta"] = 0.1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path), "--calib", str(bad)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checksum" in err[0]
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path), "--calib", str(p), "--orca-delta", "0.3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "0.05, 0.1, 0.2" in err[0]
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path), "--orca-delta", "0.05"])
    assert e.value.code == 2 and "--calib" in capsys.readouterr().err


def test_orca_object_n_choices():
    _, s = resolve({"n": 2}, DEFAULTS, BUNDLE)
    o = orca_object(s, {0: orca_result(steps_scored=1), 1: None})
    assert o["choices"][0]["steps_scored"] == 1 and "no orca result" in o["choices"][1]["error"]
    assert "steps_scored" not in o and math.isclose(o["lambda"], 0.5)


def test_bundle_route():
    from fastapi import FastAPI

    from orca_serve.api_server.server import add_orca_routes

    async def go(bundle):
        app = FastAPI()
        add_orca_routes(app, orca_server(bundle, DEFAULTS, bundle_path="/b.json"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            return await c.get("/v1/orca/bundle")

    r = run(go(None))
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "NotFoundError" and "--calib" in r.json()["error"]["message"]
    r = run(go(BUNDLE))
    assert r.status_code == 200 and r.json()["path"] == "/b.json"
    assert r.json()["probe"]["variant"] == "noqk" and "weights" not in r.json()["probe"]


# -- hardening: hostile bodies, split UTF-8, other routes, one rule for disabled requests ---------
def test_deeply_nested_json_is_400_not_500():
    async def go():
        client, _engine, seen, _ = make_client()
        deep = "[" * 100_000 + "]" * 100_000
        for body in ('{"messages": ' + deep + "}", deep, '{"n": ' + "9" * 5000 + "}"):
            r = await client.post("/v1/chat/completions", content=body,
                                  headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text[:200]
            err = r.json()["error"]
            assert err["code"] == 400 and err["type"] == "BadRequestError"
            assert "JSON" in err["message"]
        assert not seen
    run(go())


def split_utf8_app(text: str):
    """A downstream route that streams `text` as SSE, cutting every multi-byte character in two."""

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": text},
                                         "finish_reason": "stop"}]}
        raw = f"data: {json.dumps(chunk, ensure_ascii=False)}\n\ndata: [DONE]\n\n".encode()
        cuts = [i + 1 for i, b in enumerate(raw) if b >= 0xC0]  # just after each lead byte
        start = 0
        for cut in [*cuts, len(raw)]:
            await send({"type": "http.response.body", "body": raw[start:cut], "more_body": True})
            start = cut
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def test_sse_multibyte_character_split_across_chunks():
    text = "é 中文 🙂"

    async def go():
        engine = FakeEngine()
        state = orca_server(BUNDLE, DEFAULTS, metrics=OrcaMetrics(CollectorRegistry()),
                            engine=engine)
        app = OrcaMiddleware(split_utf8_app(text), state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            r = await client.post("/v1/chat/completions", json={"stream": True})
        events = [e for e in r.content.decode("utf-8").split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunk = json.loads(events[0][len("data: "):])
        assert chunk["choices"][0]["delta"]["content"] == text and "orca" in chunk
    run(go())


@pytest.mark.parametrize("path", ["/v1/chat/completions/batch", "/inference/v1/generate"])
@pytest.mark.parametrize("body, param", [
    ({"orca": {"policy": "shadow"}}, "orca"),
    ({"orca": "garbage"}, "orca"),
    ({"vllm_xargs": {"orca_policy": "shadow"}}, "vllm_xargs.orca_policy"),
    ({"sampling_params": {"extra_args": {"orca_enabled": 1}}},
     "sampling_params.extra_args.orca_enabled"),
])
def test_orca_on_routes_that_cannot_report_it_is_400(path, body, param):
    async def go():
        client, _engine, seen, _ = make_client()
        r = await client.post(path, json={"model": "m", **body})
        assert r.status_code == 400 and not seen
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "BadRequestError"
        assert "/v1/chat/completions" in err["message"] and path in err["message"]
        r = await client.post(path, json={"model": "m", "vllm_xargs": {"other": 1}})
        assert r.status_code == 200 and seen[-1] == {"model": "m", "vllm_xargs": {"other": 1}}
    run(go())


def test_sagemaker_invocations_are_chat_or_completions():
    async def go():
        client, _engine, seen, _ = make_client()
        r = await client.post("/invocations", json={"messages": [], "orca": {"policy": "shadow"}})
        assert r.status_code == 200 and r.json()["orca"]["policy"] == "shadow"
        assert seen[-1]["vllm_xargs"]["orca_policy"] == "shadow"
        r = await client.post("/invocations", json={"prompt": ["a", "b"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    run(go())


@pytest.mark.parametrize("bundle", [BUNDLE, None])
def test_disabled_request_with_other_settings_is_one_rule(bundle):
    """`enabled: false` switches orca off whatever else the object holds, with or without a bundle;
    the other fields are still type-checked."""
    defaults = DEFAULTS if bundle else OrcaDefaults(enabled=False)
    out, s = resolve({"orca": {"enabled": False, "delta": 0.1, "policy": "stop"}}, defaults,
                     bundle)
    assert "orca" not in out and (s is None or not s.enabled)
    out, s = resolve({"orca": {"enabled": False, "delta": 0.33}}, defaults, bundle)  # not in table
    assert s is None or not s.enabled
    with pytest.raises(OrcaRequestError) as e:
        resolve({"orca": {"enabled": False, "delta": "x"}}, defaults, bundle)
    assert e.value.param == "orca.delta"


def test_refused_request_is_not_fetched_from_the_engine():
    """A body vLLM refuses (huge n) never reached the engine: nothing to fetch, no hang."""
    async def go():
        engine, seen = FakeEngine(), []

        async def refuse(scope, receive, send):
            seen.append(json.loads((await receive())["body"]))
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": {}}'})

        state = orca_server(BUNDLE, DEFAULTS, metrics=OrcaMetrics(CollectorRegistry()),
                            engine=engine)
        app = OrcaMiddleware(refuse, state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            r = await asyncio.wait_for(client.post("/v1/chat/completions",
                                                   json={"n": 10**12, "messages": []}), 10)
            await asyncio.sleep(0.05)
        assert r.status_code == 400 and seen and not engine.calls
    run(go())


def test_metrics_carry_model_name_and_rate_able_probe_time():
    m = OrcaMetrics(CollectorRegistry(), model_name="my-model")
    m.observe(orca_result(steps_scored=2, reasoning_tokens=10, last_score=0.2))
    m.update_engine_stats([{"probe_ns": 3_000_000, "engine_steps": 6}])
    text = generate_latest(m.registry).decode()
    for line in ('orca_requests_total{model_name="my-model",outcome="finished"} 1.0',
                 'orca_steps_scored_total{model_name="my-model"} 2.0',
                 'orca_probe_seconds_total{model_name="my-model"} 0.003',
                 'orca_engine_steps_total{model_name="my-model"} 6.0'):
        assert line in text, line
    samples = [ln for ln in text.splitlines() if ln.startswith("orca_") and not ln.startswith("#")]
    assert samples and all('model_name="my-model"' in ln for ln in samples)
    assert "orca_probe_seconds_per_engine_step" not in text  # a lifetime mean: use rate()s


def test_cpu_build_keeps_prefills_whole():
    """On vLLM's CPU build a chunked prefill of a seeded request kills the engine: the CLI turns
    chunked prefill off and refuses the options that would chunk a prefill again."""
    import argparse

    from vllm.platforms import current_platform

    from orca_serve.checks.errors import StartupError
    from orca_serve.startup.vllm_setup import keep_prefills_whole

    if not current_platform.is_cpu():
        pytest.skip("the guard applies to vLLM's CPU build only")

    def ns(**kw):
        base = {"enable_chunked_prefill": None, "long_prefill_token_threshold": 0,
                "max_num_batched_tokens": None, "max_model_len": None}
        return argparse.Namespace(**{**base, **kw})

    args = ns()
    keep_prefills_whole(args)
    assert args.enable_chunked_prefill is False
    args = ns(max_num_batched_tokens=4096, max_model_len=1024)
    keep_prefills_whole(args)
    assert args.enable_chunked_prefill is False
    for bad, word in ((ns(enable_chunked_prefill=True), "--enable-chunked-prefill"),
                      (ns(long_prefill_token_threshold=64), "--long-prefill-token-threshold"),
                      (ns(max_num_batched_tokens=512, max_model_len=1024), "below"),
                      (ns(max_num_batched_tokens=256), "below the model's context length 512")):
        with pytest.raises(StartupError, match=word) as e:
            keep_prefills_whole(bad, lambda args: 512)
        assert "seed" in str(e.value) and "\n" not in str(e.value)


def test_a_bundle_serves_in_its_dtype_and_the_demo_with_its_reasoning_parser(tmp_path):
    """orca-serve computes in the dtype the bundle's hidden states were (vLLM's `auto` is
    bfloat16 on the CPU build for a float32 model, such as the demos'), --demo with its
    reasoning parser besides: unless the command line names them (or a vLLM config file,
    which may name the dtype)."""
    from orca_method.bundle import load_bundle
    from orca_serve.startup.preflight import (
        bundle_dtype_argv,
        demo_argv,
        demo_paths,
        preflight,
    )

    assert demo_argv(["--port", "8000"], tmp_path) == [
        "--model", str(tmp_path), "--port", "8000", "--reasoning-parser", "deepseek_r1"]
    for named in (["--reasoning-parser", "qwen3"], ["--reasoning_parser=qwen3"]):
        assert demo_argv(named, tmp_path) == ["--model", str(tmp_path), *named]
    assert bundle_dtype_argv(["--port", "1"], "float32") == ["--port", "1", "--dtype", "float32"]
    for named in (["--dtype", "bfloat16"], ["--dtype=bfloat16"], ["--config", "vllm.yaml"]):
        assert bundle_dtype_argv(named, "float32") == named
    assert bundle_dtype_argv([], None) == []  # a bundle that records none: vLLM's auto
    for name in ("toy", "long"):
        model, bundle = demo_paths(name)
        shipped = load_bundle(bundle)
        recorded = shipped.collected_under()
        for argv in (preflight(["--demo", name]).argv,
                     preflight(["--model", str(model), "--calib", str(bundle),
                                "--served-model-name", shipped.model.name]).argv):
            assert argv[argv.index("--dtype") + 1] == recorded.dtype == "float32"
