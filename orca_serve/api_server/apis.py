"""The client APIs orca runs on, and where each one carries orca's settings and its report.

vLLM 0.32 serves three APIs that reasoning clients call, and all three reach the engine with
`SamplingParams.extra_args` taken from the body's `vllm_xargs` (`ChatCompletionRequest`,
`ResponsesRequest.to_sampling_params`, and `AnthropicServingMessages`, which builds a chat request
with the Messages body's `vllm_xargs`). So the middleware rewrites all three bodies the same way
(`orca_serve.settings.resolve.resolve`); they differ in

- where the reasoning effort is (`reasoning_effort`, `reasoning.effort`, `output_config.effort`)
  and vLLM's own thinking budget (`thinking_token_budget`; Messages: `thinking.budget_tokens`;
  the Responses API has none in vLLM 0.32);
- the error shape of a 400 (OpenAI's `{"error": {...}}`; Anthropic's `{"type": "error",
  "error": {"type": "invalid_request_error", "message"}}`, which has no `param`: the message
  names the field);
- which JSON object or stream event is the finished response that gets the `orca` object, and
  where its `usage` counts reasoning tokens (chat: `completion_tokens_details.reasoning_tokens`;
  Responses: `output_tokens_details.reasoning_tokens`; Anthropic's usage has no such field, so
  there only `orca.reasoning_tokens` says it).

Each `Api` below holds those differences; the middleware
(`orca_serve.api_server.middleware`) calls them.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from orca_method.outcomes import FinishReason
from orca_serve.api_server.vote_stream import (
    Event,
    chunk_events,
    message_events,
    response_events,
)
from orca_serve.settings.contract import OrcaResult, StopReason
from orca_serve.settings.field import OrcaRequestError, error_body
from orca_serve.vllm_compat.engine_client import engine_request_id

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
INVOCATIONS_PATH = "/invocations"  # SageMaker: vLLM validates the body as chat, else completions
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"


class Report(Protocol):
    """What an Api needs of the middleware's per-request bookkeeping (`middleware._Request`)."""

    fetch_all: Callable[[], Awaitable[None]]
    fetch: Callable[[list[int]], Awaitable[None]]
    orca: Callable[..., dict[str, Any]]
    reasoning_spent: Callable[[], int | None]
    note_finished: Callable[[dict[int, str]], None]  # per choice, in chat's finish_reason terms
    status: int | None  # of vLLM's response, once it started (set by `shaping.ResponseShaper`)


def _get(body: dict[str, Any], *path: str) -> Any:
    for name in path:
        if not isinstance(body, dict):
            return None
        body = body.get(name)
    return body


def _set_reasoning_usage(usage: Any, details: str, spent: int | None) -> None:
    """`usage[details].reasoning_tokens` = the reasoning tokens the engine really generated."""
    if spent is None or not isinstance(usage, dict):
        return
    d = usage.get(details)
    usage[details] = {**(d if isinstance(d, dict) else {}), "reasoning_tokens": spent}


class Api:
    """OpenAI chat and completions (and /invocations, which vLLM hands to one of them)."""

    usage_details: str | None = "completion_tokens_details"
    # `orca.samples` (orca_serve/api_server/voting.py): the usage counts a vote sums over its
    # samples, and whether its stream (orca_serve/api_server/vote_stream.py) ends `data: [DONE]`
    usage_counts: tuple[str, ...] = ("prompt_tokens", "completion_tokens", "total_tokens")
    usage_output = "completion_tokens"  # the one of them that counts generated tokens
    stream_done = True
    effort_path: tuple[str, ...] = ("reasoning_effort",)  # where the body says its effort

    def completions(self, path: str, body: dict[str, Any]) -> bool:
        """Whether the body is a /v1/completions request (one result key per prompt)."""
        return path == COMPLETIONS_PATH or (path == INVOCATIONS_PATH and "messages" not in body)

    def effort(self, body: dict[str, Any]) -> str | None:
        v = _get(body, *self.effort_path)
        return v if isinstance(v, str) else None

    def thinking_budget(self, body: dict[str, Any]) -> int | None:
        v = body.get("thinking_token_budget")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    def check(self, body: dict[str, Any]) -> None:
        """Refusals particular to the API for a request orca runs on (OrcaRequestError)."""

    def sample(self, body: dict[str, Any], base_id: str, completions: bool
               ) -> tuple[dict[str, Any], str, bool]:
        """A vote's sample request: (its body, its engine request id, whether `base_id` goes in
        the X-Request-Id header). Chat and completions take the header."""
        return body, engine_request_id(base_id, "completions" if completions else "chat"), True

    def answer_text(self, response: dict[str, Any]) -> str:
        """The text after the reasoning of a finished response's one answer (chat: the
        message's content, which a reasoning parser keeps apart from the reasoning;
        completions: the text)."""
        choice = (response.get("choices") or [{}])[0]
        if "message" in choice:
            return (choice.get("message") or {}).get("content") or ""
        return choice.get("text") or ""

    def finish_reason(self, response: dict[str, Any]) -> str | None:
        """How a finished response's one answer ended, in chat's terms (`stop`, `abort`...)."""
        return ((response.get("choices") or [{}])[0]).get("finish_reason")

    def as_one(self, response: dict[str, Any]) -> dict[str, Any]:
        """A sample's response as the answer of the whole request (its one choice, index 0)."""
        return {**response, "choices": [{**response["choices"][0], "index": 0}]}

    def is_response(self, obj: Any) -> bool:
        """Whether a JSON body is a finished response of this API (else: an error)."""
        return isinstance(obj, dict) and bool(obj.get("choices"))

    def vote_events(self, response: dict[str, Any], body: dict[str, Any]) -> list[Event]:
        """A voted answer (`as_one`'s, with its `orca` object) as this API's stream events."""
        return chunk_events(response, bool((body.get("stream_options") or {}).get(
            "include_usage")))

    def error(self, message: str, param: str | None) -> dict[str, Any]:
        return error_body(message, param)

    def _finish(self, obj: dict[str, Any], req: Report) -> None:
        obj["orca"] = req.orca()
        if self.usage_details is not None:
            _set_reasoning_usage(obj.get("usage"), self.usage_details, req.reasoning_spent())

    @staticmethod
    def _finished(choices: Any) -> dict[int, str]:
        """{choice index: finish_reason} of the choices that finished (`length`: cut by
        max_tokens; the live audit leaves such choices out)."""
        return {c.get("index", 0): c["finish_reason"] for c in choices or []
                if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)}

    async def on_json(self, obj: Any, req: Report) -> bool:
        """Add the report to a finished JSON response; False: not one (left as it is)."""
        if not isinstance(obj, dict) or "choices" not in obj:
            return False
        req.note_finished(self._finished(obj["choices"]))
        await req.fetch_all()
        self._finish(obj, req)
        return True

    async def on_event(self, event: str | None, obj: Any, req: Report) -> bool:
        """Add the report to a stream event (`event`: its SSE event name); False: untouched.

        The chunk with a choice's `finish_reason` gets that choice's report; the final usage
        chunk (no choices) gets everything."""
        if not isinstance(obj, dict) or "choices" not in obj:
            return False
        choices = obj.get("choices") or []
        reasons = self._finished(choices)
        req.note_finished(reasons)
        finished = list(reasons)
        if finished:
            await req.fetch(finished)
            obj["orca"] = req.orca(finished)
            return True
        if not choices and obj.get("usage") is not None:
            await req.fetch_all()
            self._finish(obj, req)
            return True
        return False


class ResponsesApi(Api):
    """OpenAI's Responses API: the `orca` object on the response (plain) and on the response of
    the stream's closing event (`response.completed` / `response.incomplete`)."""

    usage_details = "output_tokens_details"
    usage_counts = ("input_tokens", "output_tokens", "total_tokens")
    usage_output = "output_tokens"
    stream_done = False  # its stream ends with the closing event
    CLOSING = ("response.completed", "response.incomplete", "response.failed")
    effort_path = ("reasoning", "effort")

    def completions(self, path: str, body: dict[str, Any]) -> bool:
        return False

    def thinking_budget(self, body: dict[str, Any]) -> int | None:
        return None

    def check(self, body: dict[str, Any]) -> None:
        if body.get("background") is True:
            raise OrcaRequestError("orca early stopping is reported in the response, and a "
                                   "background response is fetched later: send the request "
                                   "without 'background', or disable orca with "
                                   "\"orca\": {\"enabled\": false}", "background")

    def sample(self, body: dict[str, Any], base_id: str, completions: bool
               ) -> tuple[dict[str, Any], str, bool]:
        # the Responses route takes its request id from the body, not the header
        return {**body, "request_id": base_id}, engine_request_id(base_id, "responses"), False

    def answer_text(self, response: dict[str, Any]) -> str:
        return "".join(c.get("text") or "" for item in response.get("output") or []
                       if isinstance(item, dict) and item.get("type") == "message"
                       for c in item.get("content") or []
                       if isinstance(c, dict) and c.get("type") == "output_text")

    def finish_reason(self, response: dict[str, Any]) -> str | None:
        if response.get("status") == "completed":
            return FinishReason.STOP
        why = _get(response, "incomplete_details", "reason")
        return FinishReason.LENGTH if why == "max_output_tokens" else why or response.get("status")

    def as_one(self, response: dict[str, Any]) -> dict[str, Any]:
        return dict(response)

    def is_response(self, obj: Any) -> bool:
        return isinstance(obj, dict) and obj.get("object") == "response"

    def vote_events(self, response: dict[str, Any], body: dict[str, Any]) -> list[Event]:
        return response_events(response)

    async def on_json(self, obj: Any, req: Report) -> bool:
        if not self.is_response(obj):
            return False
        status, why = obj.get("status"), _get(obj, "incomplete_details", "reason")
        if status == "completed":
            req.note_finished({0: FinishReason.STOP})
        elif status == "incomplete":
            req.note_finished({0: FinishReason.LENGTH if why == "max_output_tokens"
                               else FinishReason.ABORT})
        await req.fetch_all()
        self._finish(obj, req)
        return True

    async def on_event(self, event: str | None, obj: Any, req: Report) -> bool:
        if event not in self.CLOSING or not isinstance(obj, dict):
            return False
        return await self.on_json(obj.get("response"), req)


class MessagesApi(Api):
    """Anthropic's Messages API: the `orca` object on the message (plain) and on the stream's
    `message_delta` event (the one with `stop_reason` and the final usage)."""

    usage_details = None  # Anthropic's usage has no reasoning-token count
    usage_counts = ("input_tokens", "output_tokens")
    usage_output = "output_tokens"
    stream_done = False  # its stream ends with message_stop
    effort_path = ("output_config", "effort")

    def completions(self, path: str, body: dict[str, Any]) -> bool:
        return False

    def thinking_budget(self, body: dict[str, Any]) -> int | None:
        if _get(body, "thinking", "type") != "enabled":
            return None
        v = _get(body, "thinking", "budget_tokens")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    def error(self, message: str, param: str | None) -> dict[str, Any]:
        return anthropic_error(message)

    @staticmethod
    def _chat_reason(stop_reason: Any) -> FinishReason | None:
        """Anthropic's `stop_reason` in chat's terms (`max_tokens`: `length`)."""
        if not isinstance(stop_reason, str):
            return None
        return FinishReason.LENGTH if stop_reason == "max_tokens" else FinishReason.STOP

    def _note(self, stop_reason: Any, req: Report) -> None:
        if (reason := self._chat_reason(stop_reason)) is not None:
            req.note_finished({0: reason})

    # a vote's sample: vLLM runs a message through its chat route (its X-Request-Id, chat's
    # engine request id), so `sample` is chat's

    def answer_text(self, response: dict[str, Any]) -> str:
        """The message's text blocks (its thinking blocks hold the reasoning)."""
        return "".join(b.get("text") or "" for b in response.get("content") or []
                       if isinstance(b, dict) and b.get("type") == "text")

    def finish_reason(self, response: dict[str, Any]) -> str | None:
        return self._chat_reason(response.get("stop_reason"))

    def as_one(self, response: dict[str, Any]) -> dict[str, Any]:
        return response  # a message is one answer

    def is_response(self, obj: Any) -> bool:
        return isinstance(obj, dict) and obj.get("type") == "message"

    def vote_events(self, response: dict[str, Any], body: dict[str, Any]) -> list[Event]:
        return message_events(response)

    async def on_json(self, obj: Any, req: Report) -> bool:
        if not self.is_response(obj):
            return False
        self._note(obj.get("stop_reason"), req)
        await req.fetch_all()
        self._finish(obj, req)
        return True

    async def on_event(self, event: str | None, obj: Any, req: Report) -> bool:
        if event != "message_delta" or not isinstance(obj, dict):
            return False
        self._note(_get(obj, "delta", "stop_reason"), req)
        await req.fetch_all()
        self._finish(obj, req)
        return True


# Anthropic's error types by HTTP status (its API reference, "Errors"); others: api_error
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         529: "overloaded_error"}


def anthropic_error(message: str, status: int = 400) -> dict[str, Any]:
    """Anthropic's error shape (its `type` names the class of error, not a field)."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500
                                     else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def as_anthropic_error(body: bytes, status: int) -> bytes | None:
    """An error body of a /v1/messages route in Anthropic's shape; None when it is no JSON error.

    vLLM answers some errors there in OpenAI's shape (its request validation: `{"error":
    {"message", "type": "Bad Request", ...}}`) and others in Anthropic's with vLLM's own type
    names (`BadRequestError`); Anthropic's clients read `error.type` as one of theirs.
    """
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    message = _get(obj, "error", "message")
    if not isinstance(message, str):
        message = _get(obj, "detail") if isinstance(_get(obj, "detail"), str) else None
    if message is None:
        return None
    return json.dumps(anthropic_error(message, status)).encode()


CHAT = Api()
APIS: dict[str, Api] = {CHAT_PATH: CHAT, COMPLETIONS_PATH: CHAT, INVOCATIONS_PATH: CHAT,
                        RESPONSES_PATH: ResponsesApi(), MESSAGES_PATH: MessagesApi()}
ORCA_PATHS = tuple(APIS)


def thinking_ended_by(result: OrcaResult, budget: int | None) -> str | None:
    """What closed the reasoning: `orca` (the probe), `orca_give_up` (the give-up threshold:
    orca forced the end, whichever give-up policy wrote what followed), `orca_answer_reserve`
    (policy answer made room for the answer before max_tokens), `thinking_token_budget` (vLLM's
    budget: it closed with as many reasoning tokens as the budget, counting those the prompt
    opened, and no stop of orca's), `model` (the model's own end tag or EOS), or None (still
    reasoning at the end: max_tokens, a stop string, an abort)."""
    if result.stop_reason == StopReason.PROBE:
        return "orca"
    if result.stop_reason == StopReason.GIVE_UP:
        return "orca_give_up"
    if result.stop_reason == StopReason.BUDGET:
        return "orca_answer_reserve"
    if not result.reasoning_closed:
        return None
    spent = result.reasoning_tokens + result.prompt_reasoning_tokens
    if budget is not None and spent >= budget:
        return "thinking_token_budget"
    return "model"


def reasoning_spent(result: OrcaResult) -> int:
    """Reasoning tokens one choice generated: the plugin's count, plus the request's last token
    when it ended still reasoning (the last token has no hidden state, so the plugin never
    counts it)."""
    return result.reasoning_tokens + (0 if result.reasoning_closed else 1)
