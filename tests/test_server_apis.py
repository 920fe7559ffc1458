"""The Responses and Messages APIs, reasoning effort and vLLM's thinking budget, end to end: one
real orca-serve on the tiny model (the bundle of test_server: delta 0.2 -> lambda 0.5, stops at
step 1; 0.1 -> lambda 0.99, never reached; 0.05 -> never), the real `openai` client, the real
`anthropic` client where it is installed (it is not a dependency of this project) and raw HTTP
for the Messages API everywhere. The server is conftest's `tiny_server`, shared with test_server.

The server runs with `--orca-effort-map medium=0.1`, so the efforts map to: low -> 0.2 (the
largest delta: stops), medium -> 0.1 (the option), high -> 0.05 (the smallest), xhigh/max -> off.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.serving import MSG, orca_of, server_model

pytestmark = pytest.mark.vllm

QUESTION = MSG[0]["content"]
STOP = {"delta": 0.2, "policy": "stop"}


@pytest.fixture(scope="module")
def srv(tiny_server):
    return tiny_server["server"].wait()


def test_responses_api_stops_early_and_reports_it(srv):
    c = srv.client()
    r = c.responses.create(model=server_model(srv), input=QUESTION, max_output_tokens=200,
                           temperature=0, extra_body={"orca": {"delta": 0.2, "policy": "answer",
                                                               "answer_budget": 6}})
    o = orca_of(r)
    assert o["stopped_early"] is True and o["stop_step"] == 1 and o["lambda"] == 0.5
    assert o["thinking_ended_by"] == "orca" and r.status == "completed"
    assert r.usage.output_tokens <= o["reasoning_tokens"] + o["forced_tokens"] + 6 + 1
    assert r.usage.output_tokens_details.reasoning_tokens == o["reasoning_tokens"]
    full = c.responses.create(model=server_model(srv), input=QUESTION, max_output_tokens=200,
                              temperature=0, extra_body={"orca": {"enabled": False}})
    assert orca_of(full) == {"enabled": False}
    assert full.usage.output_tokens > r.usage.output_tokens


def test_responses_api_stream_reports_on_the_completed_event(srv):
    events = list(srv.client().responses.create(
        model=server_model(srv), input=QUESTION, max_output_tokens=200, temperature=0,
        stream=True, extra_body={"orca": STOP}))
    with_orca = [e for e in events if "orca" in (getattr(e, "response", None) and
                                                 e.response.model_extra or {})]
    assert [e.type for e in with_orca] == ["response.completed"] and events[-1] is with_orca[0]
    o = with_orca[0].response.model_extra["orca"]
    assert o["stopped_early"] is True and o["stop_step"] == 1 and o["policy"] == "stop"
    assert with_orca[0].response.usage.output_tokens_details.reasoning_tokens == \
        o["reasoning_tokens"]


def test_responses_api_errors_in_openai_shape(srv):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().responses.create(model=server_model(srv), input=QUESTION,
                                      extra_body={"orca": {"delta": 0.07}})
    assert e.value.body["param"] == "orca.delta"
    assert "available deltas: 0.05, 0.1, 0.2" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().responses.create(model=server_model(srv), input=QUESTION, background=True,
                                      extra_body={"orca": STOP})
    assert e.value.body["param"] == "background"


def messages_body(**kw) -> dict:
    return {"model": "m", "max_tokens": 200, "messages": MSG, "temperature": 0, **kw}


def test_messages_api_over_http(srv):
    body = messages_body(model=server_model(srv), orca=STOP)
    r = httpx.post(srv.url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["type"] == "message" and msg["orca"]["stopped_early"] is True
    assert msg["orca"]["stop_step"] == 1 and msg["usage"]["output_tokens"] < 50
    events = []
    with httpx.stream("POST", srv.url + "/v1/messages", json={**body, "stream": True},
                      timeout=120) as s:
        for block in s.read().decode().split("\n\n"):
            if block.strip():
                name, data = block.split("\n", 1)
                events.append((name.removeprefix("event: "), json.loads(data[len("data: "):])))
    with_orca = [n for n, d in events if "orca" in d]
    assert with_orca == ["message_delta"]
    assert dict(events)["message_delta"]["orca"]["stopped_early"] is True
    r = httpx.post(srv.url + "/v1/messages", json={**body, "orca": {"policy": "often"}}, timeout=30)
    err = r.json()
    assert r.status_code == 400 and err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error" and "orca.policy" in err["error"]["message"]


def test_messages_api_with_the_anthropic_client(srv):
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed")
    a = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120)
    msg = a.messages.create(model=server_model(srv), max_tokens=200, messages=MSG,
                            extra_body={"orca": STOP})
    o = msg.model_extra["orca"]
    assert o["stopped_early"] is True and o["stop_step"] == 1 and msg.stop_reason == "end_turn"
    with a.messages.stream(model=server_model(srv), max_tokens=200, messages=MSG,
                           extra_body={"orca": STOP}) as stream:
        deltas = [e for e in stream if e.type == "message_delta"]
    assert len(deltas) == 1 and deltas[0].model_extra["orca"]["stopped_early"] is True
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=server_model(srv), max_tokens=20, messages=MSG,
                          extra_body={"orca": {"delta": 0.07}})
    assert "available deltas" in e.value.body["error"]["message"]


def test_messages_api_client_errors_in_anthropic_shape(srv):
    """vLLM's own refusals on /v1/messages come back in Anthropic's shape with Anthropic's
    types (its request validation answers in OpenAI's), and are logged without a traceback
    (test_zz below: no Traceback and no ERROR line in the whole log)."""
    cases = [  # body -> status, Anthropic's type, what the message names
        (messages_body(model=server_model(srv), thinking={"type": "enabled",
                                                          "budget_tokens": 100}),
         400, "invalid_request_error", "budget_tokens"),  # vLLM: >= 1024 (request validation)
        (messages_body(model=server_model(srv), max_tokens=600, thinking={
            "type": "enabled", "budget_tokens": 1024}), 400, "invalid_request_error",
         "budget_tokens"),  # < max_tokens
        (messages_body(model=server_model(srv), max_tokens=5000), 400, "invalid_request_error",
         "max_model_len")]  # raised in vLLM's handler, logged with logger.exception
    for body, status, kind, names in cases:
        r = httpx.post(srv.url + "/v1/messages", json=body, timeout=30)
        err = r.json()
        assert r.status_code == status and err["type"] == "error", r.text
        assert err["error"]["type"] == kind and names in err["error"]["message"], r.text
        assert int(r.headers["content-length"]) == len(r.content)


@pytest.mark.parametrize("effort, delta, lam, stops", [
    ("low", 0.2, 0.5, True), ("medium", 0.1, 0.99, False), ("high", 0.05, None, False)])
def test_reasoning_effort_chooses_lambda(srv, effort, delta, lam, stops):
    c = srv.client()
    r = c.chat.completions.create(model=server_model(srv), messages=MSG, max_tokens=40,
                                  temperature=0, reasoning_effort=effort)
    o = orca_of(r)
    assert (o["delta"], o["lambda"], o["stopped_early"]) == (delta, lam, stops)
    assert o["delta_source"] == "effort" and o["reasoning_effort"] == effort
    r = c.responses.create(model=server_model(srv), input=QUESTION, max_output_tokens=40,
                           temperature=0, reasoning={"effort": effort})
    assert (orca_of(r)["lambda"], orca_of(r)["stopped_early"]) == (lam, stops)
    if not stops:  # an explicit delta wins over the effort
        o = orca_of(c.chat.completions.create(model=server_model(srv), messages=MSG,
                                              max_tokens=40, temperature=0,
                                              reasoning_effort=effort, extra_body={"orca": STOP}))
        assert o["stopped_early"] is True and o["delta_source"] == "request"


def test_highest_effort_runs_without_early_stop(srv):
    r = srv.client().chat.completions.create(model=server_model(srv), messages=MSG, max_tokens=40,
                                             temperature=0, reasoning_effort="xhigh")
    assert orca_of(r) == {"enabled": False, "reasoning_effort": "xhigh"}
    assert r.usage.completion_tokens == 40


def test_thinking_token_budget_and_orca_whichever_ends_thinking_first(srv):
    c = srv.client()

    def ask(orca: dict, budget: int):
        return c.chat.completions.create(
            model=server_model(srv), messages=MSG, max_tokens=80, temperature=0,
            extra_body={"orca": orca, "thinking_token_budget": budget,
                        "skip_special_tokens": False})

    # orca never stops (shadow): vLLM's budget of 10 ends the reasoning
    r = ask({"delta": 0.1, "policy": "shadow"}, 10)
    o = orca_of(r)
    assert o["thinking_ended_by"] == "thinking_token_budget" and o["thinking_token_budget"] == 10
    assert o["stopped_early"] is False and o["reasoning_tokens"] <= 10
    assert r.choices[0].message.content  # the answer after vLLM's forced end of thinking
    assert r.usage.completion_tokens_details.reasoning_tokens == o["reasoning_tokens"]
    # orca stops at step 1, long before a budget of 60
    o = orca_of(ask({"delta": 0.2, "policy": "answer"}, 60))
    assert o["thinking_ended_by"] == "orca" and o["stopped_early"] is True


def test_usage_counts_reasoning_tokens_spent(srv):
    """A request that reasons to max_tokens: every completion token is a reasoning token."""
    r = srv.client().chat.completions.create(model=server_model(srv), messages=MSG, max_tokens=30,
                                             temperature=0,
                                             extra_body={"orca": {"delta": 0.1, "policy": "shadow"}})
    o = orca_of(r)
    assert o["thinking_ended_by"] is None and r.usage.completion_tokens == 30
    assert r.usage.completion_tokens_details.reasoning_tokens == 30


def test_zz_sigterm_shuts_down_without_an_error_traceback(srv):
    """Last in the module: SIGTERM to orca-serve's process group (Ctrl-C in a terminal and
    systemd signal every process of the server, its engine's included)."""
    import os
    import signal

    os.killpg(srv.proc.pid, signal.SIGTERM)
    srv.proc.wait(60)
    log = srv.log.read_text()
    assert "shutdown triggered" in log
    # the engine process's orca lines in vLLM's format too (its gate alarm's are warnings)
    assert re.search(r"\(EngineCore[^)]*\) INFO [^\n]*\[adapter.py:\d+\] orca core ready", log)
    assert "Traceback" not in log and "EngineDeadError" not in log and " ERROR " not in log
