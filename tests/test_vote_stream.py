"""A voted answer streamed on every API (orca_serve/api_server/vote_stream.py), without vLLM: each
API's events checked against the real clients' own event types, and the stream read by the
real `openai` and `anthropic` clients through the orca middleware over test_voting's fake of
vLLM's routes (sample i with seed 1 + i finishes at (1 + i) / 100 s answering (1 + i) % 2, so
sample 0 settles the vote on "1" at t* = 0 and the rest are aborted); a malformed stream request
is a 400 on each."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import CollectorRegistry
from pydantic import TypeAdapter

from orca_serve.api_server.middleware import OrcaMiddleware
from orca_serve.api_server.vote_stream import chunk_events, message_events, response_events
from orca_serve.metrics.prometheus import OrcaMetrics
from orca_serve.settings.resolve import OrcaDefaults
from orca_serve.vllm_compat.engine_client import engine_request_id
from tests.servers import orca_server
from tests.test_vote_audit import as_message_route, reshaped
from tests.test_voting import MSG, FakeClient, bundle, fake_chat_route

ORCA = {"vote": {"k": 4, "answer": "1", "ended": "settled"}, "samples": [{"index": 0}]}
USAGE = {"input_tokens": 3, "output_tokens": 7, "total_tokens": 10,
         "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
         "output_tokens_details": {"reasoning_tokens": 5}}


def a_response(text: str, reasoning: str = "2 and 2", status: str = "completed") -> dict:
    """A finished Responses API response as vLLM writes one (a reasoning item, a message)."""
    return {"id": "resp_1", "object": "response", "created_at": 1, "model": "m",
            "status": status, "incomplete_details": None if status == "completed"
            else {"reason": "max_output_tokens"}, "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "temperature": 1.0, "top_p": 1.0,
            "output": [{"id": "rs_1", "type": "reasoning", "summary": [], "status": None,
                        "content": [{"type": "reasoning_text", "text": reasoning}]},
                       {"id": "msg_1", "type": "message", "role": "assistant",
                        "status": "completed", "content": [
                            {"type": "output_text", "text": text, "annotations": [],
                             "logprobs": None}]}],
            "usage": USAGE}


def test_the_responses_api_gets_its_typed_events_numbered_and_closed_by_status():
    from openai.types.responses import ResponseStreamEvent

    events = response_events({**a_response("\\boxed{4}"), "orca": ORCA})
    adapter = TypeAdapter(ResponseStreamEvent)
    for name, e in events:  # each one of the client's own event types
        assert name == e["type"] and adapter.validate_python(e).type == name
    names = [n for n, _ in events]
    assert names == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.reasoning_text.delta", "response.reasoning_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert events[0][1]["response"]["status"] == "in_progress"
    assert events[0][1]["response"]["output"] == [] and "orca" not in events[0][1]["response"]
    assert events[10][1]["delta"] == "\\boxed{4}" and events[4][1]["delta"] == "2 and 2"
    assert events[-1][1]["response"]["orca"] == ORCA  # only the closing event carries it
    assert sum("orca" in json.dumps(e) for _, e in events) == 1
    cut = response_events(a_response("\\boxed{4}", status="incomplete"))
    assert cut[-1][0] == "response.incomplete"


def test_the_messages_api_gets_anthropics_events_with_orca_on_message_delta():
    types = pytest.importorskip("anthropic.types", reason="the anthropic client is not installed")
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
               "content": [{"type": "thinking", "thinking": "2 and 2", "signature": "s1"},
                           {"type": "text", "text": "\\boxed{4}"},
                           {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}],
               "stop_reason": "end_turn", "stop_sequence": None,
               "usage": {"input_tokens": 3, "output_tokens": 7}, "orca": ORCA}
    events = message_events(message)
    adapter = TypeAdapter(types.RawMessageStreamEvent)
    for name, e in events:
        assert name == e["type"] and adapter.validate_python(e).type == name
    deltas = [e["delta"] for n, e in events if n == "content_block_delta"]
    assert deltas == [{"type": "thinking_delta", "thinking": "2 and 2"},
                      {"type": "signature_delta", "signature": "s1"},
                      {"type": "text_delta", "text": "\\boxed{4}"},
                      {"type": "input_json_delta", "partial_json": '{"a": 1}'}]
    starts = [e["content_block"] for n, e in events if n == "content_block_start"]
    assert starts[1] == {"type": "text", "text": ""} and starts[2]["input"] == {}
    assert events[0][1]["message"]["content"] == [] and "orca" not in events[0][1]["message"]
    (_, last), (stop, _) = events[-2:]
    assert last["type"] == "message_delta" and last["orca"] == ORCA and stop == "message_stop"
    assert last["usage"] == {"input_tokens": 3, "output_tokens": 7}


def test_chat_chunks_are_unnamed_data_events():
    response = {"id": "c", "created": 1, "model": "m", "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                             "finish_reason": "stop"}], "orca": ORCA}
    events = chunk_events(response, include_usage=False)
    assert all(name is None for name, _ in events)
    assert [e["choices"][0]["finish_reason"] for _, e in events] == [None, None, "stop"]
    assert events[-1][1]["orca"] == ORCA


# ------------------------------------------------------ through the middleware, real clients


def as_response(c: dict) -> dict:
    """A fake chat route's answer as vLLM's Responses route writes it."""
    choice = c["choices"][0]
    return {**a_response(choice["message"]["content"], status="completed"
                         if choice["finish_reason"] == "stop" else "incomplete"),
            "id": "resp_" + c["id"]}


def voting_app() -> tuple[OrcaMiddleware, FakeClient]:
    """The orca middleware over fake chat, Responses and Messages routes."""
    client, seen = FakeClient(), []
    server = orca_server(bundle(), OrcaDefaults(enabled=True, delta=0.1), engine=client,
                         metrics=OrcaMetrics(CollectorRegistry()))
    chat = fake_chat_route(client, seen)
    # its engine request id from the body's `request_id`, as vLLM's Responses route takes it
    responses = reshaped(fake_chat_route(
        client, seen, lambda scope, body: engine_request_id(body["request_id"], "responses")),
        as_response)
    messages = as_message_route(chat)

    async def routes(scope, receive, send):
        app = {"/v1/responses": responses, "/v1/messages": messages}.get(scope["path"], chat)
        await app(scope, receive, send)

    return OrcaMiddleware(routes, server), client


def asgi_client(app, http=httpx) -> httpx.AsyncClient:
    """An HTTP client of `app` (`http`: the httpx package the client library uses)."""
    return http.AsyncClient(transport=http.ASGITransport(app=app), base_url="http://t")


def test_the_openai_client_streams_a_voted_response():
    import openai

    app, engine = voting_app()

    async def go():
        async with asgi_client(app) as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
            raw = [e async for e in await client.responses.create(
                model="m", input="2+2?", stream=True,
                extra_body={"seed": 1, "orca": {"samples": 4}})]
            async with client.responses.stream(model="m", input="2+2?",
                                               extra_body={"seed": 1, "orca": {"samples": 4}}
                                               ) as s:
                text = "".join([e.delta async for e in s
                                if e.type == "response.output_text.delta"])
                final = await s.get_final_response()
            return raw, text, final

    raw, text, final = asyncio.run(go())
    assert raw[0].type == "response.created" and raw[-1].type == "response.completed"
    assert "".join(e.delta for e in raw
                   if e.type == "response.output_text.delta") == "\\boxed{1}"
    vote = raw[-1].response.model_extra["orca"]["vote"]
    assert vote["answer"] == "1" and vote["ended"] == "settled" and vote["k"] == 4
    assert text == "\\boxed{1}" and final.output_text == "\\boxed{1}"
    assert final.model_extra["orca"]["vote"]["sample"] == 0
    assert engine.aborted  # by the Responses route's engine request ids


def test_the_anthropic_client_streams_a_voted_message():
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed")
    app, engine = voting_app()

    async def go():
        async with asgi_client(app, pytest.importorskip("httpx2")) as http:
            client = anthropic.AsyncAnthropic(base_url="http://t", api_key="x", http_client=http)
            async with client.messages.stream(model="m", max_tokens=50, messages=MSG,
                                              extra_body={"seed": 1, "orca": {"samples": 4}}
                                              ) as s:
                events = [e async for e in s]
                return events, await s.get_final_message()

    events, final = asyncio.run(go())
    assert final.content[0].text == "\\boxed{1}" and final.stop_reason == "end_turn"
    (delta,) = [e for e in events if e.type == "message_delta"]
    assert delta.model_extra["orca"]["vote"]["answer"] == "1"
    assert engine.aborted


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"stream": True, "stream_options": 5}, "stream_options"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": "y"}},
     "stream_options"),
    ("/v1/responses", {"stream": 1}, "stream"),
    ("/v1/messages", {"stream": "true"}, None),  # Anthropic's shape names no param
])
def test_a_malformed_voted_stream_request_is_a_clear_400(path, extra, param):
    app, engine = voting_app()
    body = ({"input": "2+2?"} if path == "/v1/responses" else {"messages": MSG, "max_tokens": 8})

    async def go():
        async with asgi_client(app) as http:
            return await http.post(path, json={"model": "m", **body, **extra,
                                               "orca": {"samples": 4}})

    r = asyncio.run(go())
    assert r.status_code == 400, r.text
    if param is None:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "'stream'" in err["message"]
    else:
        assert r.json()["error"]["param"] == param
    assert engine.aborted == [] and not engine.results  # no sample ran
