"""vLLM's OpenAI-compatible FastAPI app plus orca-serve's additions.

Nothing of vLLM's request handling is re-implemented. `install` adds to the app vLLM's `build_app`
made (`run` has vLLM's launcher pass it through `install`: orca_serve/vllm_compat/launch.py says
why that is not done through `--middleware`):

- `OrcaMiddleware` (pure ASGI, innermost, so vLLM's auth/CORS run first) on POST
  /v1/chat/completions, /v1/completions (and SageMaker's /invocations, which vLLM dispatches to
  one of them), /v1/responses and /v1/messages (`orca_serve.apis`: what differs between those
  APIs): it validates the body's `orca` field (400 in the API's error format when malformed),
  rewrites the body (removes `orca`, writes the resolved settings and a fresh `orca_key` into
  `vllm_xargs`), lets vLLM's own route run, then adds the `orca` object to the JSON response or
  to the stream's finishing chunks or events, from the plugin's results fetched with
  `engine_client.collective_rpc("orca_results", ...)`. Every other POST route with a JSON body
  (/v1/chat/completions/batch, /inference/v1/generate, ...) cannot report what orca did, so orca
  settings there are a 400, never silently ignored (the engine runs those requests without
  orca: see `cli.py`). On GET /metrics it first refreshes the plugin's cumulative probe-time
  counters (`orca_stats`).
- GET /v1/orca/bundle: `Bundle.summary()` (404 without a bundle); POST /v1/orca/bundle and SIGHUP
  swap in a new bundle without a restart (`orca_serve.reload`). Every orca-enabled response names
  the bundle that served it (`bundle_checksum`).
- The `orca` request field in the published OpenAPI description (/openapi.json).
- Metrics (`orca_serve.metrics`) on vLLM's `/metrics`.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import json
import logging
import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse
from starlette.middleware import Middleware

from orca_method.bundle import Bundle, load_bundle
from orca_serve import quiet_shutdown
from orca_serve.apis import (
    APIS,
    CHAT_PATH,
    INVOCATIONS_PATH,
    MESSAGES_PATH,
    ORCA_PATHS,
    Api,
    as_anthropic_error,
    reasoning_spent,
    thinking_ended_by,
)
from orca_serve.contract import DEFAULTS, POLICIES, child_key, ended
from orca_serve.effort import DEFAULT_EFFORT_MAP
from orca_serve.live_audit.route import add_audit_route
from orca_serve.metrics import OrcaMetrics
from orca_serve.reload import BUNDLE_PATH, AdminMiddleware, Reloader, route_path, send_json
from orca_serve.requests import (
    OrcaDefaults,
    OrcaFields,
    OrcaRequestError,
    OrcaSettings,
    error_body,
    orca_param_in,
    resolve,
)
from orca_serve.server_log import deferred_errors, release
from orca_serve.vllm_compat import launch
from orca_serve.vllm_compat.engine_client import max_choices, rpc_all
from orca_serve.vllm_plugin import merge_results

logger = logging.getLogger("orca_serve.server")

RESULT_FIELDS = ("steps_scored", "stopped_early", "stop_step", "would_stop_step", "last_score",
                 "reasoning_tokens", "forced_tokens")
RPC_TIMEOUT_S = 30.0


# -- results from the engine --------------------------------------------------------------------
class ResultFetcher:
    """Fetches plugin results for many requests with few RPCs.

    Callers await `get(keys)`; keys asked for while an RPC is in flight are batched into the next
    one, so 64 requests finishing together cost a handful of collective_rpc calls, not 64.
    """

    def __init__(self, rpc: Callable[..., Any]) -> None:
        self._rpc = rpc  # async (method, args) -> list per worker
        self._pending: dict[str, list[asyncio.Future]] = {}
        self._task: asyncio.Task | None = None

    async def get(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        loop = asyncio.get_running_loop()
        futs = []
        for k in keys:
            f = loop.create_future()
            self._pending.setdefault(k, []).append(f)
            futs.append(f)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush())
        values = await asyncio.gather(*futs)
        return {k: v for k, v in zip(keys, values) if v is not None}

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let requests finishing in the same tick join this batch
        while self._pending:
            batch, self._pending = self._pending, {}
            keys = list(batch)
            merged: dict[str, dict[str, Any]] = {}
            try:
                per_worker = await asyncio.wait_for(self._rpc("orca_results", (keys,)),
                                                    RPC_TIMEOUT_S)
                merged = {k: v for k, v in merge_results(per_worker).items() if k in batch}
            except Exception as e:  # noqa: BLE001 - a failed fetch must not fail the response
                logger.warning("orca: fetching results for %d request(s) failed: %r", len(keys), e)
            for k, futs in batch.items():
                for f in futs:
                    if not f.done():
                        f.set_result(merged.get(k))


def _num(v: Any) -> float | None:
    if v is None:
        return None
    v = float(v)
    return None if math.isinf(v) or math.isnan(v) else v


def choice_fields(result: dict[str, Any] | None, bundle: str | None = None,
                  thinking_budget: int | None = None) -> dict[str, Any]:
    """Per-choice part of the `orca` object from one plugin result (zeros when none came).
    `bundle`: the checksum the server resolved lambda* with; the engine must have served the
    request with the same bundle (an error says so otherwise). `thinking_budget`: the request's
    vLLM `thinking_token_budget` (`thinking_ended_by` says which of the two ended thinking)."""
    r = result or {}
    forced = r.get("forced_tokens") or 0
    out = {
        "steps_scored": int(r.get("steps_scored") or 0),
        "stopped_early": bool(r.get("stopped_early") or False),
        "stop_step": r.get("stop_step"),
        "would_stop_step": r.get("would_stop_step"),
        "last_score": _num(r.get("last_score")),
        "reasoning_tokens": int(r.get("reasoning_tokens") or 0),
        "forced_tokens": len(forced) if isinstance(forced, (list, tuple)) else int(forced),
        "stop_reason": r.get("stop_reason"),
        "ended": ended(bool(r.get("stopped_early")), r.get("stop_reason")),
        "thinking_ended_by": thinking_ended_by(r, thinking_budget),
    }
    if r.get("give_up_mu") is not None or r.get("last_give_up_score") is not None:
        out["give_up_step"] = r.get("give_up_step")
        out["last_give_up_score"] = _num(r.get("last_give_up_score"))
    if r.get("notes"):
        out["notes"] = [str(x) for x in r["notes"]]
    if r.get("error"):
        out["error"] = str(r["error"])
    if result is None:
        out["error"] = "the engine reported no orca result for this request"
    served = r.get("bundle_checksum")
    if bundle is not None and served is not None and served != bundle:
        out["error"] = f"served by bundle {served}, resolved with bundle {bundle}"
    return out


def orca_object(settings: OrcaSettings, results: dict[int, dict[str, Any] | None]) -> dict[str, Any]:
    """The response's `orca` object. n == 1: flat; n > 1: common fields + `choices` list."""
    effort = {} if settings.effort is None else {"reasoning_effort": settings.effort}
    if not settings.enabled:
        return {"enabled": False, **effort}
    obj: dict[str, Any] = {"enabled": True, "policy": settings.policy, "delta": settings.delta,
                           "delta_source": settings.delta_source, **effort,
                           "lambda": settings.lam, "lambda_source": settings.lam_source,
                           "bundle_checksum": settings.bundle}
    if settings.thinking_budget is not None:
        obj["thinking_token_budget"] = settings.thinking_budget
    if settings.audited:
        obj["audited"] = True
    if settings.answer_budget is not None:
        obj["answer_budget"] = settings.answer_budget
    if settings.give_up_delta is not None:
        obj["give_up"] = {"delta": settings.give_up_delta, "mu": settings.give_up_mu,
                          "policy": settings.give_up_policy, "source": settings.give_up_source,
                          # an audited request runs to its end, and the audit's guard may have
                          # turned give-up off (source fallback): neither gives up
                          "active": not settings.audited and settings.give_up_source != "fallback"}
    if settings.n <= 1:
        r = results.get(0)
        if r and r.get("policy") in POLICIES:
            obj["policy"] = r["policy"]  # the plugin may run another policy (see `notes`)
        obj.update(choice_fields(r, settings.bundle, settings.thinking_budget))
    else:
        obj["choices"] = []
        for i, r in sorted(results.items()):
            c = {"index": i, **choice_fields(r, settings.bundle, settings.thinking_budget)}
            if r and r.get("policy") not in (None, settings.policy):
                c["policy"] = r["policy"]
            obj["choices"].append(c)
    return obj


# -- app state ----------------------------------------------------------------------------------
@dataclass
class OrcaState:
    bundle: Bundle | None
    defaults: OrcaDefaults
    metrics: OrcaMetrics | None = None
    engine_client: Any = None  # set lazily from app.state.engine_client
    fetcher: ResultFetcher | None = None
    bundle_path: str | None = None
    audit: Any = None  # orca_serve.live_audit.live.LiveAudit
    reloader: Reloader | None = None  # hot reload (None without a bundle)
    _app_state: Any = field(default=None, repr=False)

    def client(self) -> Any:
        if self.engine_client is None and self._app_state is not None:
            self.engine_client = getattr(self._app_state, "engine_client", None)
        return self.engine_client

    async def rpc(self, method: str, args: tuple = ()) -> Any:
        """`collective_rpc` on every engine this API server talks to (a request's result lives
        on the engine that ran it): one answer per worker."""
        client = self.client()
        if client is None:
            raise RuntimeError("engine client not ready")
        return await rpc_all(client, method, args)

    def get_fetcher(self) -> ResultFetcher:
        if self.fetcher is None:
            self.fetcher = ResultFetcher(self.rpc)
        return self.fetcher

    async def refresh_engine_stats(self) -> None:
        if self.metrics is None or self.bundle is None:
            return
        try:
            stats = await asyncio.wait_for(self.rpc("orca_stats"), 5.0)
        except Exception as e:  # noqa: BLE001
            logger.warning("orca: reading orca_stats failed: %r", e)
            return
        self.metrics.update_engine_stats(stats)


# -- the middleware -----------------------------------------------------------------------------


def _dumps(obj: Any) -> str:
    # vLLM writes chunks with pydantic's model_dump_json: compact separators, unicode kept.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _Request:
    """Per-request bookkeeping: which choices got their result, and the final accounting."""

    def __init__(self, state: OrcaState, settings: OrcaSettings) -> None:
        self.state = state
        self.settings = settings
        self.results: dict[int, dict[str, Any] | None] = {}
        self.finish_reasons: dict[int, str | None] = {}  # per choice, as the response gave them
        self.audit = state.audit  # the one that admitted it (a reload may replace state.audit)
        self.observed = False
        self.status: int | None = None  # of vLLM's response, once it started

    def note_finished(self, reasons: dict[int, str]) -> None:
        """Record how choices finished, in chat's terms (`stop`, `length`, ...: apis.py)."""
        self.finish_reasons.update(reasons)

    def keys(self, indexes: list[int]) -> list[str]:
        return [child_key(self.settings.key, i, self.settings.n) for i in indexes]

    async def fetch(self, indexes: list[int]) -> None:
        todo = [i for i in indexes if i not in self.results]
        if not todo:
            return
        if not self.settings.enabled:
            for i in todo:
                self.results[i] = None
            return
        got = await self.state.get_fetcher().get(self.keys(todo))
        for i, k in zip(todo, self.keys(todo)):
            self.results[i] = got.get(k)

    async def fetch_all(self) -> None:
        if self.status is not None and 400 <= self.status < 500:
            return  # refused by vLLM's validation: the engine never saw it, nothing to fetch
        await self.fetch(list(range(max(1, min(self.settings.n, max_choices())))))

    def reasoning_spent(self) -> int | None:
        """Reasoning tokens the engine generated over all choices (the plugin counts them as
        it segments); None when orca did not run or a result is missing."""
        if not self.settings.enabled or not self.results:
            return None
        if any(r is None for r in self.results.values()):
            return None
        return sum(reasoning_spent(r) for r in self.results.values())

    def orca(self, indexes: list[int] | None = None) -> dict[str, Any]:
        if indexes is None:
            return orca_object(self.settings, self.results)
        return orca_object(self.settings, {i: self.results.get(i) for i in indexes})

    def account(self) -> None:
        """Metrics, once per request, for every choice that got a result (or is disabled)."""
        if self.observed or self.state.metrics is None:
            return
        if self.status is not None and 400 <= self.status < 500:
            return  # never ran
        self.observed = True
        s = self.settings
        for i in range(max(1, s.n)):
            if s.enabled and self.results.get(i) is None:
                continue
            r = self.results.get(i) or {}
            obj = {"enabled": s.enabled, "policy": r.get("policy") or s.policy,
                   **(choice_fields(r) if s.enabled else {})}
            self.state.metrics.observe(obj)


class OrcaMiddleware:
    """Pure ASGI middleware: body rewrite in, `orca` object out. See the module docstring."""

    def __init__(self, app: Any, state: OrcaState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
            with deferred_errors() as held:
                return await self._route(scope, receive, _AnthropicErrors(send, held), path)
        return await self._route(scope, receive, send, path)

    async def _route(self, scope: dict, receive: Callable, send: Callable, path: str) -> None:
        method = scope.get("method")
        if method == "GET" and (path == "/metrics" or path.startswith("/metrics/")):
            await self.state.refresh_engine_stats()
            return await self.app(scope, receive, send)
        if method != "POST" or (path not in ORCA_PATHS and not _json_body(scope)):
            return await self.app(scope, receive, send)
        await self._handle(scope, receive, send, path)

    async def _handle(self, scope: dict, receive: Callable, send: Callable, path: str) -> None:
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body_bytes = b"".join(chunks)
        api = APIS.get(path)
        error = (api or _error_api(path)).error
        settings: OrcaSettings | None = None
        new_bytes = body_bytes
        try:
            body = json.loads(body_bytes) if body_bytes else None
        except json.JSONDecodeError:
            body = None  # vLLM answers with its own error
        except UnicodeDecodeError as e:
            return await send_json(send, 400, error(
                f"the request body is not valid JSON: it is not UTF-8 ({e.reason} at byte "
                f"{e.start})", None))
        except RecursionError:
            return await send_json(send, 400, error(
                "the request body is not valid JSON: it is nested too deeply", None))
        except ValueError as e:  # e.g. an integer with more digits than Python converts
            return await send_json(send, 400, error(
                f"the request body is not valid JSON: {str(e).split(';')[0]}", None))
        if isinstance(body, dict) and api is None:
            param = orca_param_in(body)
            if param is not None:
                return await send_json(send, 400, error(
                    f"'{param}' is not supported on {path}: orca early stopping runs on "
                    f"{', '.join(ORCA_PATHS)} only, whose responses report what it did; "
                    "requests on other routes run without it", param))
            return await self.app(scope, _replay(body_bytes, receive), send)
        if isinstance(body, dict) and api is not None:
            try:
                new_body, settings = resolve(body, self.state.defaults, self.state.bundle,
                                             completions=api.completions(path, body),
                                             effort=api.effort(body),
                                             thinking_budget=api.thinking_budget(body))
                if settings is not None and settings.enabled:
                    api.check(body)
            except OrcaRequestError as e:
                return await send_json(send, 400, error(e.message, e.param))
            if settings is not None and self.state.audit is not None:
                new_body, settings = self.state.audit.admit(new_body, settings)
            if new_body is not body:
                new_bytes = json.dumps(new_body).encode()

        replay = _replay(new_bytes, receive)
        if new_bytes is not body_bytes:
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(new_bytes)).encode()))
            scope = dict(scope, headers=headers)
        if settings is None:
            return await self.app(scope, replay, send)

        req = _Request(self.state, settings)
        if self.state.reloader is not None:
            self.state.reloader.started(settings)
        try:
            await self.app(scope, replay, _ResponseShaper(req, api or APIS[CHAT_PATH], send))
        finally:
            # Fetch every result exactly once (also after errors and disconnects) so the plugin
            # can forget the request, and account it in the metrics.
            task = asyncio.ensure_future(_finish(req))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)


class _AnthropicErrors:
    """The `send` of a /v1/messages route: an error response in Anthropic's shape, whoever wrote
    it (vLLM's request validation answers in OpenAI's; `apis.as_anthropic_error`), and the
    handler's error log records released by the status (`server_log.release`)."""

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


def _error_api(path: str) -> Api:
    """The API whose error shape a route outside ORCA_PATHS answers in (Anthropic's under
    /v1/messages, e.g. count_tokens; OpenAI's elsewhere)."""
    return APIS[MESSAGES_PATH] if path.startswith(MESSAGES_PATH + "/") else APIS[CHAT_PATH]


def _json_body(scope: dict) -> bool:
    """Whether the request says its body is JSON (the only bodies that can carry orca fields)."""
    for k, v in scope.get("headers", []):
        if k.lower() == b"content-type":
            return b"json" in v.lower()
    return False


def _replay(body: bytes, receive: Callable) -> Callable:
    """A `receive` that hands the (read, maybe rewritten) body to the app once, then waits on the
    client as the original would (vLLM's handlers watch it for disconnects)."""
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


_BACKGROUND: set[asyncio.Future] = set()


async def _finish(req: _Request) -> None:
    try:
        await req.fetch_all()
    finally:
        req.account()
        if req.audit is not None:
            req.audit.finished(req.settings, req.results, req.finish_reasons)
        if req.state.reloader is not None:
            req.state.reloader.finished(req.settings)


class _ResponseShaper:
    """The `send` wrapper: adds `orca` to a finished JSON response or to a stream's finishing
    events, where the request's API (`orca_serve.apis`) says they are."""

    def __init__(self, req: _Request, api: Api, send: Callable) -> None:
        self.req = req
        self.api = api
        self.send = send
        self.start: dict | None = None
        self.mode: str | None = None  # "json" | "sse" | "pass"
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
                self.mode = "pass"
            elif ctype.startswith("text/event-stream"):
                self.mode = "sse"
            elif ctype.startswith("application/json"):
                self.mode = "json"
            else:
                self.mode = "pass"
            if self.mode == "json":
                self.start = msg  # held until the body is complete (content-length changes)
                return
            return await self.send(msg)
        if t != "http.response.body" or self.mode == "pass":
            return await self.send(msg)
        if self.mode == "json":
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


# -- routes and app -----------------------------------------------------------------------------
def add_orca_routes(app: Any, state: OrcaState) -> None:

    # No return annotation: under `from __future__ import annotations` FastAPI would have to
    # resolve the string "JSONResponse" when it builds /openapi.json, and fail (HTTP 500).
    async def orca_bundle():
        if state.bundle is None:
            return JSONResponse(error_body(
                "this server runs without a calibration bundle (start orca-serve with --calib)",
                code=404, err_type="NotFoundError"), status_code=404)
        out = {"path": state.bundle_path, **state.bundle.summary()}
        if state.reloader is not None and state.reloader.last is not None:
            out["last_reload"] = state.reloader.last
        return JSONResponse(out)

    app.add_api_route(BUNDLE_PATH, orca_bundle, methods=["GET"], name="orca_bundle",
                      response_model=None)


ORCA_SCHEMA = "OrcaFields"


def add_orca_to_openapi(schema: dict[str, Any]) -> dict[str, Any]:
    """vLLM's OpenAPI description plus the `orca` request field on the routes that take it.

    vLLM's request models do not know the field (the middleware removes it before they see it),
    so without this the published schema hides it from clients and schema-driven tools.
    """
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    orca = OrcaFields.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(orca.pop("$defs", {}))  # nested models (`give_up`) where refs point
    components[ORCA_SCHEMA] = orca
    field = {"anyOf": [{"$ref": f"#/components/schemas/{ORCA_SCHEMA}"}, {"type": "null"}],
             "description": "orca-serve: calibrated early stopping of the reasoning "
                            "(docs/SERVER.md); every field optional"}
    for path in sorted(set(ORCA_PATHS) - {INVOCATIONS_PATH}):
        op = (schema.get("paths", {}).get(path) or {}).get("post") or {}
        ref = (op.get("requestBody", {}).get("content", {}).get("application/json", {})
               .get("schema", {}).get("$ref", ""))
        model = components.get(ref.rsplit("/", 1)[-1]) if ref else None
        if model is not None:
            model.setdefault("properties", {})["orca"] = field
    return schema


def _install_openapi(app: Any) -> None:
    vllm_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = add_orca_to_openapi(vllm_openapi())
        return app.openapi_schema

    app.openapi = openapi


def install(app: Any, state: OrcaState) -> Any:
    """Add the orca route and middleware to a FastAPI app built by vLLM (before it serves)."""
    state._app_state = app.state
    app.state.orca = state
    add_orca_routes(app, state)
    _install_openapi(app)
    add_audit_route(app, lambda: state.audit)
    if state.audit is not None:
        state.audit.engine_client = state.client
    # Innermost: append (add_middleware would put ours outside vLLM's auth and CORS).
    app.user_middleware.append(Middleware(OrcaMiddleware, state=state))
    # Outermost: the admin route's own credential is checked before vLLM's --api-key.
    app.user_middleware.insert(0, Middleware(AdminMiddleware, reloader=state.reloader))
    if app.middleware_stack is not None:  # vLLM's SageMaker bootstrap already built it
        app.middleware_stack = app.build_middleware_stack()
    return app


def orca_defaults(args: Any, bundle: Bundle | None) -> OrcaDefaults:
    """Server-wide request defaults from the parsed command line (--orca-* options)."""
    if bundle is None:
        return OrcaDefaults(enabled=False)
    table = getattr(args, "orca_effort_map", None)
    return OrcaDefaults(
        enabled=True,
        delta=args.orca_delta if args.orca_delta is not None else bundle.default_delta,
        policy=args.orca_policy, answer_budget=args.orca_answer_budget,
        effort_map=dict(DEFAULT_EFFORT_MAP if table is None else table),
        give_up_delta=getattr(args, "orca_give_up_delta", None),
        give_up_policy=getattr(args, "orca_give_up_policy", None) or DEFAULTS["give_up_policy"])


def served_model_name(args: Any) -> str:
    """The model name vLLM serves and puts in its metrics' `model_name` label."""
    names = getattr(args, "served_model_name", None)
    if isinstance(names, list):
        return str(names[0]) if names else str(args.model)
    return str(names or args.model)


def state_from_args(args: Any) -> OrcaState:
    """The server's state, from the parsed command line alone (`args.calib`: the bundle, already
    checked at start), so that every API server process can build its own."""
    bundle = load_bundle(args.calib) if args.calib else None
    state = OrcaState(bundle=bundle, defaults=orca_defaults(args, bundle),
                      metrics=(OrcaMetrics(model_name=served_model_name(args))
                               if bundle is not None else None),
                      bundle_path=str(Path(args.calib).absolute()) if args.calib else None)
    if bundle is not None:
        key_env = getattr(args, "orca_admin_key_env", None)
        state.reloader = Reloader(state, calib_path=state.bundle_path,
                                  fixed_delta=getattr(args, "orca_delta", None),
                                  admin_key=os.environ.get(key_env) if key_env else None)
        state.metrics.bundle_in_use(bundle.checksum)
    return state


def install_own_state(app: Any) -> Any:
    """`install` with a state of this process's own, from the parsed command line vLLM keeps
    in `app.state.args` (each API server process under --api-server-count N)."""
    state = state_from_args(app.state.args)
    quiet_shutdown.install(state.client)
    return install(app, state)


def run(args: Any, state: OrcaState) -> None:
    """Serve with vLLM's own launchers (orca_serve.vllm_compat.launch), our parts in its app.

    One API server: vLLM's `run_server` in this process, serving `state`. Several
    (--api-server-count N): vLLM's `run_multi_api_server` (engines started here, N spawned API
    server processes sharing the port), each process building its own state and app. Each has
    its own engine client; a request's result is fetched by key with collective_rpc from any of
    them, so whichever process answers a request gets it.
    """
    if (getattr(args, "api_server_count", None) or 1) > 1:
        launch.run_multi(args, install_own_state)
        return

    quiet_shutdown.install(state.client)

    def on_loop() -> None:
        if state.reloader is not None:  # SIGHUP re-reads --calib (orca_serve.reload)

            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP,
                                                          state.reloader.on_sighup)

    launch.run_single(args, functools.partial(install, state=state), on_loop)
