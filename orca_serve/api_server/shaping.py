"""The `send` wrappers of the orca middleware: the `orca` report written into a finished JSON
response or a stream's finishing events (where the request's API says, `orca_serve.api_server.apis`), and
Anthropic's error shape on the Messages API's routes.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from orca_serve.api_server.apis import Api, Report, as_anthropic_error
from orca_serve.api_server.log import release


def _dumps(obj: Any) -> str:
    # vLLM writes chunks with pydantic's model_dump_json: compact separators, unicode kept.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class Body(StrEnum):
    """How a response's body is shaped: JSON (held whole, the `orca` object added), SSE (events
    rewritten as they pass), or passed through untouched (an error status, another type)."""

    JSON = "json"
    SSE = "sse"
    PASS = "pass"


class AnthropicErrors:
    """The `send` of a /v1/messages route: an error response in Anthropic's shape, whoever wrote
    it (vLLM's request validation answers in OpenAI's; `apis.as_anthropic_error`), and the
    handler's error log records released by the status (`log.release`)."""

    def __init__(self, send: Callable, held: list) -> None:
        self.send = send
        self.held = held
        self.start: dict | None = None
        self.buf = bytearray()

    async def __call__(self, msg: dict) -> None:
        if msg["type"] == "http.response.start":
            release(self.held, int(msg.get("status") or 0))
            headers = {k.lower(): v for k, v in msg.get("headers", [])}
            if int(msg.get("status") or 0) >= 400 and \
                    headers.get(b"content-type", b"").startswith(b"application/json"):
                self.start = msg  # held until the body is complete
                return None
            return await self.send(msg)
        if self.start is None or msg["type"] != "http.response.body":
            return await self.send(msg)
        self.buf += msg.get("body", b"")
        if msg.get("more_body", False):
            return None
        start, self.start = self.start, None
        body = as_anthropic_error(bytes(self.buf), int(start["status"])) or bytes(self.buf)
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.send({**start, "headers": headers})
        return await self.send({"type": "http.response.body", "body": body, "more_body": False})



class ResponseShaper:
    """The `send` wrapper: adds `orca` to a finished JSON response or to a stream's finishing
    events, where the request's API (`orca_serve.api_server.apis`) says they are."""

    def __init__(self, req: Report, api: Api, send: Callable) -> None:
        self.req = req
        self.api = api
        self.send = send
        self.start: dict | None = None
        self.mode: Body | None = None  # set by the response's start
        self.buf = bytearray()
        self.sse_buf = ""
        # SSE bodies may split a multi-byte UTF-8 character across two messages
        self.sse_decoder = codecs.getincrementaldecoder("utf-8")()

    async def __call__(self, msg: dict) -> None:
        t = msg["type"]
        if t == "http.response.start":
            self.req.status = int(msg.get("status") or 0)
            headers = {k.lower(): v for k, v in msg.get("headers", [])}
            ctype = headers.get(b"content-type", b"").decode("latin-1")
            if msg.get("status") != 200:
                self.mode = Body.PASS
            elif ctype.startswith("text/event-stream"):
                self.mode = Body.SSE
            elif ctype.startswith("application/json"):
                self.mode = Body.JSON
            else:
                self.mode = Body.PASS
            if self.mode == Body.JSON:
                self.start = msg  # held until the body is complete (content-length changes)
                return
            return await self.send(msg)
        if t != "http.response.body" or self.mode == Body.PASS:
            return await self.send(msg)
        if self.mode == Body.JSON:
            self.buf += msg.get("body", b"")
            if msg.get("more_body", False):
                return
            return await self._send_json()
        return await self._send_sse(msg)

    async def _send_json(self) -> None:
        data = bytes(self.buf)
        try:
            obj = json.loads(data)
            if await self.api.on_json(obj, self.req):
                data = json.dumps(obj, ensure_ascii=False).encode()
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
        start = dict(self.start or {})
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(data)).encode()))
        start["headers"] = headers
        await self.send(start)
        await self.send({"type": "http.response.body", "body": data, "more_body": False})

    async def _send_sse(self, msg: dict) -> None:
        more = msg.get("more_body", False)
        self.sse_buf += self.sse_decoder.decode(msg.get("body", b""), final=not more)
        out = []
        while "\n\n" in self.sse_buf:
            event, self.sse_buf = self.sse_buf.split("\n\n", 1)
            out.append(await self._event(event) + "\n\n")
        if not more and self.sse_buf:
            out.append(self.sse_buf)
            self.sse_buf = ""
        if out or not more:
            await self.send({"type": "http.response.body", "body": "".join(out).encode("utf-8"),
                             "more_body": more})

    async def _event(self, event: str) -> str:
        """One SSE event (`data: ...`, after an `event: name` line on the Responses and Messages
        APIs): rewritten with the report where the API says, else byte for byte."""
        lines = event.split("\n")
        at = next((i for i, ln in enumerate(lines) if ln.startswith("data: ")), None)
        if at is None or lines[at].startswith("data: [DONE]"):
            return event
        name = next((ln[len("event: "):] for ln in lines if ln.startswith("event: ")), None)
        try:
            obj = json.loads(lines[at][len("data: "):])
        except json.JSONDecodeError:
            return event
        if not await self.api.on_event(name, obj, self.req):
            return event
        lines[at] = "data: " + _dumps(obj)
        return "\n".join(lines)
