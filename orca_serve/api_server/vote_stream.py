"""A voted answer as a stream (`orca.samples` with `"stream": true`; docs/SERVER.md "Streaming a
voted answer"), on every API orca serves.

The answer is not known before the vote settles, and then it is known whole (the voted
sample's finished response, with the `orca` object: every sample's result and how the group
ended), so the stream is that response re-cut into the events the API's clients expect, sent at
once. One sending (`stream_vote`: the SSE framing, the headers, the one body); what differs per
API is only how a finished response is cut (`Api.vote_events`, one function each below), and
where the `orca` object goes, which is where that API's non-vote stream carries it:

- chat: `chat.completion.chunk`s (the role, the reasoning where the reasoning parser kept it
  apart, the content, then the chunk with `finish_reason`, which carries the `orca` object);
  completions: `text_completion` chunks likewise; the usage chunk when
  `stream_options.include_usage` asks for it (with `orca` too); then `data: [DONE]`;
- Responses: its typed events (`response.created`, `response.in_progress`, per output item
  `response.output_item.added`, per content part `response.content_part.added`, one
  `response.output_text.delta` / `response.reasoning_text.delta` with the whole text, the
  `.done`s, `response.output_item.done`), numbered by `sequence_number`, closed by
  `response.completed` (`response.incomplete` / `response.failed` by the response's status),
  whose `response` carries `orca`;
- Messages: Anthropic's (`message_start`, per content block `content_block_start`, one
  `text_delta` / `thinking_delta` / `input_json_delta` with the whole block, a `signature_delta`
  where the block is signed, `content_block_stop`, then `message_delta` with the stop reason, the
  usage and `orca`, and `message_stop`).

A refusal (a sample's error) is answered by the middleware as vLLM answers one to a stream
request: a JSON error body.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

REASONING_KEYS = ("reasoning_content", "reasoning")  # where vLLM's parsers put the reasoning

Event = tuple[str | None, dict[str, Any]]  # (its SSE `event:` name; None: a bare `data:`), data


def chunk_events(response: dict[str, Any], include_usage: bool) -> list[Event]:
    """The stream chunks of a finished chat or completions response of one choice."""
    choice = response["choices"][0]
    chat = "message" in choice
    head = {k: response[k] for k in ("id", "created", "model") if k in response}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    extra = {k: choice.get(k) for k in ("logprobs",)}

    def chunk(part: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, **part, **extra, "finish_reason": finish}]}

    out = []
    if chat:
        msg = choice.get("message") or {}
        out.append(chunk({"delta": {"role": msg.get("role") or "assistant", "content": ""}}))
        for key in REASONING_KEYS:
            if msg.get(key):
                out.append(chunk({"delta": {key: msg[key]}}))
        if msg.get("content"):
            out.append(chunk({"delta": {"content": msg["content"]}}))
        last = chunk({"delta": {}}, choice.get("finish_reason"))
    else:
        if choice.get("text"):
            out.append(chunk({"text": choice["text"]}))
        last = chunk({"text": ""}, choice.get("finish_reason"))
        last["choices"][0]["stop_reason"] = choice.get("stop_reason")
    last["orca"] = response.get("orca")
    out.append(last)
    if include_usage:
        out.append({**head, "choices": [], "usage": response.get("usage"),
                    "orca": response.get("orca")})
    return [(None, c) for c in out]


# Responses: the content parts streamed as text, by type: (the events' prefix, the text's field)
RESPONSE_TEXT_PARTS = {"output_text": ("response.output_text", "text"),
                       "reasoning_text": ("response.reasoning_text", "text"),
                       "refusal": ("response.refusal", "refusal")}
RESPONSE_CLOSING = {"completed": "response.completed", "incomplete": "response.incomplete",
                    "failed": "response.failed"}  # by the response's status


def response_events(response: dict[str, Any]) -> list[Event]:
    """The typed events of a finished Responses API response (see the module docstring). Items
    other than messages and reasoning (a function call) are added and done whole, as chat's
    stream does not re-chunk tool calls."""
    head = {k: v for k, v in response.items() if k != "orca"}
    head.update(status="in_progress", output=[], usage=None, incomplete_details=None)
    out: list[dict[str, Any]] = [{"type": "response.created", "response": head},
                                 {"type": "response.in_progress", "response": head}]
    for at, item in enumerate(response.get("output") or []):
        parts = item.get("content") if item.get("type") in ("message", "reasoning") else None
        opened = {**item, "status": "in_progress"}
        if parts is not None:
            opened["content"] = []
        out.append({"type": "response.output_item.added", "output_index": at, "item": opened})
        where = {"item_id": item.get("id"), "output_index": at}
        for i, part in enumerate(parts or []):
            prefix, field = RESPONSE_TEXT_PARTS.get(part.get("type"), (None, None))
            text = {"logprobs": []} if part.get("type") == "output_text" else {}
            at_part = {**where, "content_index": i}
            out.append({"type": "response.content_part.added", **at_part,
                        "part": {**part, field: ""} if field else part})
            if prefix is not None and part.get(field):
                out.append({"type": f"{prefix}.delta", **at_part, "delta": part[field], **text})
            if prefix is not None:
                out.append({"type": f"{prefix}.done", **at_part, field: part.get(field) or "",
                            **text})
            out.append({"type": "response.content_part.done", **at_part, "part": part})
        out.append({"type": "response.output_item.done", "output_index": at, "item": item})
    out.append({"type": RESPONSE_CLOSING.get(response.get("status"), "response.completed"),
                "response": response})
    return [(e["type"], {**e, "sequence_number": n}) for n, e in enumerate(out)]


# Messages: the content blocks streamed as one delta, by type: (the streamed field, its empty
# value in content_block_start, the delta's type, the delta's field)
MESSAGE_BLOCKS = {"text": ("text", "", "text_delta", "text"),
                  "thinking": ("thinking", "", "thinking_delta", "thinking"),
                  "tool_use": ("input", {}, "input_json_delta", "partial_json")}


def message_events(message: dict[str, Any]) -> list[Event]:
    """Anthropic's stream events of a finished message (see the module docstring). Blocks of
    other types (redacted thinking) are started whole and stopped."""
    usage = message.get("usage") or {}
    start = {k: v for k, v in message.items() if k != "orca"}
    start.update(content=[], stop_reason=None, stop_sequence=None,
                 usage={**usage, "output_tokens": 0})
    out: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for i, block in enumerate(message.get("content") or []):
        field, empty, kind, key = MESSAGE_BLOCKS.get(block.get("type"), (None,) * 4)
        opened = copy.deepcopy(block)
        if field is not None:
            opened[field] = empty
        if "signature" in block:
            opened["signature"] = ""
        out.append({"type": "content_block_start", "index": i, "content_block": opened})
        value = block.get(field) if field is not None else None
        if value:
            out.append({"type": "content_block_delta", "index": i, "delta": {
                "type": kind, key: value if isinstance(value, str) else json.dumps(value)}})
        if block.get("signature"):
            out.append({"type": "content_block_delta", "index": i, "delta": {
                "type": "signature_delta", "signature": block["signature"]}})
        out.append({"type": "content_block_stop", "index": i})
    out.append({"type": "message_delta", "delta": {"stop_reason": message.get("stop_reason"),
                                                   "stop_sequence": message.get("stop_sequence")},
                "usage": usage, "orca": message.get("orca")})
    out.append({"type": "message_stop"})
    return [(e["type"], e) for e in out]


async def stream_vote(send: Callable, events: list[Event], done: bool) -> None:
    """Send a vote's answer, cut into its API's `events`, as one SSE body (`done`: closed by
    `data: [DONE]`, as OpenAI's chunk streams are)."""
    data = "".join(("" if name is None else f"event: {name}\n")
                   + f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
                   for name, obj in events) + ("data: [DONE]\n\n" if done else "")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache")]})
    await send({"type": "http.response.body", "body": data.encode(), "more_body": False})
