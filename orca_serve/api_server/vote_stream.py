"""A voted answer as a stream (`orca.samples` with `"stream": true`; docs/SERVER.md "Streaming a
voted answer").

The answer is not known before the vote settles, and then it is known whole (the voted
sample's finished response), so the stream is that response cut into the API's own chunks, sent
at once: chat's `chat.completion.chunk`s (the role, the reasoning where the reasoning parser
kept it apart, the content, then the chunk with `finish_reason`, which carries the whole `orca`
object as a non-vote stream's finishing chunk carries its choice's), completions'
`text_completion` chunks likewise, the usage chunk when `stream_options.include_usage` asks for
it (with the `orca` object too, as on a non-vote stream), and `data: [DONE]`. A refusal (a
sample's error) is answered by the middleware as vLLM answers one to a stream request: a JSON
error body.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

REASONING_KEYS = ("reasoning_content", "reasoning")  # where vLLM's parsers put the reasoning


def vote_chunks(response: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """The stream chunks of a finished chat or completions response of one choice (a voted
    answer with its `orca` object)."""
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
    return out


async def stream_vote(send: Callable, out: dict[str, Any], body: dict[str, Any]) -> None:
    """Send a vote's answer (`Vote.response`'s, status 200) as the stream the client asked
    for."""
    include = bool((body.get("stream_options") or {}).get("include_usage"))
    data = "".join(f"data: {json.dumps(c, separators=(',', ':'))}\n\n"
                   for c in vote_chunks(out, include)) + "data: [DONE]\n\n"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache")]})
    await send({"type": "http.response.body", "body": data.encode(), "more_body": False})
