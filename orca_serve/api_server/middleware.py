"""The orca middleware: a request's `orca` field in, its `orca` report out (pure ASGI, innermost,
so vLLM's auth and CORS run first; `orca_serve.api_server.server` says where it sits and why).

On POST /v1/chat/completions, /v1/completions (and SageMaker's /invocations, which vLLM
dispatches to one of them), /v1/responses and /v1/messages (`orca_serve.api_server.apis`: what differs
between those APIs) it validates the body's `orca` field (400 in the API's error format when
malformed), rewrites the body (removes `orca`, writes the resolved settings and a fresh
`orca_key` into `vllm_xargs`), lets vLLM's own route run, then adds the `orca` object to the
JSON response or to the stream's finishing chunks or events, from the plugin's results. Every
other POST route with a JSON body cannot report what orca did, so orca settings there are a 400,
never silently ignored. On GET /metrics it first refreshes the plugin's probe-time counters.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from orca_serve.api_server.admin import route_path, send_json
from orca_serve.api_server.apis import (
    APIS,
    CHAT_PATH,
    MESSAGES_PATH,
    ORCA_PATHS,
    Api,
)
from orca_serve.api_server.asgi import replay_body
from orca_serve.api_server.assembly import OrcaServer
from orca_serve.settings.contract import OrcaResult, OrcaSettings, child_key
from orca_serve.settings.field import OrcaRequestError, orca_param_in
from orca_serve.api_server.report import orca_object, reasoning_total
from orca_serve.settings.resolve import resolve
from orca_serve.api_server.log import deferred_errors
from orca_serve.api_server.state import Serving
from orca_serve.api_server.shaping import AnthropicErrors, ResponseShaper
from orca_serve.api_server.vote_stream import stream_vote
from orca_serve.api_server.voting import LinkedEngine, Vote, call_app
from orca_serve.vllm_compat.engine_client import max_choices

logger = logging.getLogger("orca_serve.api_server.server")


class _Request:
    """Per-request bookkeeping: which choices got their result, and the final accounting."""

    def __init__(self, server: OrcaServer, serving: Serving, settings: OrcaSettings) -> None:
        self.server = server
        self.settings = settings
        self.results: dict[int, OrcaResult | None] = {}
        self.finish_reasons: dict[int, str | None] = {}  # per choice, as the response gave them
        self.audit = serving.audit  # the one that admitted it (a reload may replace it)
        self.observed = False
        self.status: int | None = None  # of vLLM's response, once it started
        self._fetching: dict[int, asyncio.Future] = {}  # choices whose fetch is in flight

    def note_finished(self, reasons: dict[int, str]) -> None:
        """Record how choices finished, in chat's terms (`stop`, `length`, ...: `apis`)."""
        self.finish_reasons.update(reasons)

    def keys(self, indexes: list[int]) -> list[str]:
        return [child_key(self.settings.key, i, self.settings.n) for i in indexes]

    async def fetch(self, indexes: list[int]) -> None:
        """The results of these choices, each asked of the engine once. The engine hands a
        result out once, so a fetch runs to its end even when its caller is cancelled (a client
        that disconnects while its finishing chunk waits for the result: the stream is
        cancelled), and a later call (`fetch_all`, after the disconnect) waits for it: before,
        the result the engine had handed out was dropped, and the request went uncounted in the
        metrics and its audit failed ("the engine reported no result")."""
        todo = [i for i in indexes if i not in self.results and i not in self._fetching]
        if todo and not self.settings.enabled:
            for i in todo:
                self.results[i] = None
        elif todo:
            task = asyncio.ensure_future(self._fetch(todo))
            self._fetching.update(dict.fromkeys(todo, task))
        running = {self._fetching[i] for i in indexes if i in self._fetching}
        if running:
            await asyncio.shield(asyncio.gather(*running))

    async def _fetch(self, todo: list[int]) -> None:
        try:
            got = await self.server.engine.fetcher.get(self.keys(todo))
            for i, k in zip(todo, self.keys(todo)):
                self.results[i] = got.get(k)
        finally:
            for i in todo:
                self._fetching.pop(i, None)

    async def fetch_all(self) -> None:
        if self.status is not None and 400 <= self.status < 500:
            return  # refused by vLLM's validation: the engine never saw it, nothing to fetch
        await self.fetch(list(range(max(1, min(self.settings.n, max_choices())))))

    def reasoning_spent(self) -> int | None:
        """Reasoning tokens the engine generated over all choices (`report.reasoning_total`)."""
        return reasoning_total(self.settings, self.results)

    def orca(self, indexes: list[int] | None = None) -> dict[str, Any]:
        if indexes is None:
            return orca_object(self.settings, self.results)
        return orca_object(self.settings, {i: self.results.get(i) for i in indexes})

    def account(self) -> None:
        """Metrics, once per request, for every choice that got a result (or is disabled)."""
        metrics = self.server.metrics
        if self.observed or metrics is None:
            return
        if self.status is not None and 400 <= self.status < 500:
            return  # never ran
        self.observed = True
        s = self.settings
        if any(r is not None and r.shift_alarm for r in self.results.values()):
            metrics.shift_alarm_served.inc()  # the engine's gate alarm served it as flagged
        for i in range(max(1, s.n)):
            if not s.enabled:
                metrics.observe(None)
            elif self.results.get(i) is not None:
                metrics.observe(self.results[i])


class OrcaMiddleware:
    """Pure ASGI middleware: body rewrite in, `orca` object out. See the module docstring."""

    def __init__(self, app: Any, server: OrcaServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
            with deferred_errors() as held:
                return await self._route(scope, receive, AnthropicErrors(send, held), path)
        return await self._route(scope, receive, send, path)

    async def _route(self, scope: dict, receive: Callable, send: Callable, path: str) -> None:
        method = scope.get("method")
        if method == "GET" and (path == "/metrics" or path.startswith("/metrics/")):
            await self.server.refresh_engine_stats()
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
            return await self.app(scope, replay_body(body_bytes, receive), send)
        serving = self.server.serving.now  # one Serving for the whole request
        if isinstance(body, dict) and api is not None:
            try:
                new_body, settings = resolve(body, serving.defaults, serving.bundle,
                                             thresholds=serving.thresholds, check=api.check,
                                             completions=api.completions(path, body),
                                             effort=api.effort(body),
                                             thinking_budget=api.thinking_budget(body))
            except OrcaRequestError as e:
                return await send_json(send, 400, error(e.message, e.param))
            if new_body is not body:
                new_bytes = json.dumps(new_body).encode()

        replay = replay_body(new_bytes, receive)
        if new_bytes is not body_bytes:
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(new_bytes)).encode()))
            scope = dict(scope, headers=headers)
        if settings is None:
            return await self.app(scope, replay, send)

        if settings.vote is not None:
            return await self._vote(scope, receive, send, api or APIS[CHAT_PATH], path,
                                    new_body, settings, serving)
        req = _Request(self.server, serving, settings)
        if self.server.reloader is not None:
            self.server.reloader.started(settings)
        try:
            await self.app(scope, replay, ResponseShaper(req, api or APIS[CHAT_PATH], send))
        finally:
            # Fetch every result exactly once (also after errors and disconnects) so the plugin
            # can forget the request, and account it in the metrics.
            task = asyncio.ensure_future(_finish(req))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)

    async def _vote(self, scope: dict, receive: Callable, send: Callable, api: Api, path: str,
                    body: dict, settings: OrcaSettings, serving: Serving) -> None:
        """`orca.samples`: k samples through vLLM's route, one voted answer
        (`orca_serve.api_server.voting`)."""
        assert serving.bundle is not None  # resolve refuses `samples` without one
        audit = serving.audit  # the one that admitted it (a reload may replace it)
        if audit is not None:  # the vote's audit: audited? t* acting or only followed?
            settings = replace(settings, vote=audit.votes.admit(settings.vote, settings.delta))
        completions = api.completions(path, body)
        vote = Vote(settings, LinkedEngine(self.server.engine), api=api, completions=completions,
                    end_tag=serving.bundle.think.end, metrics=self.server.metrics)
        gone = asyncio.Event()
        watch = asyncio.ensure_future(_watch_disconnect(receive, gone))
        if self.server.reloader is not None:
            self.server.reloader.started(settings)
        run = asyncio.ensure_future(
            vote.run(body, lambda s, b: call_app(self.app, scope, b, s.header_id, gone)))
        answered = asyncio.ensure_future(vote.answered.wait())
        try:
            # an audited group is answered once settled and its other samples run on (the
            # client's leaving after its answer no longer reaches them: `watch` ends here);
            # any other group once its aborted samples' results are in
            await asyncio.wait({run, answered} if settings.vote.audited else {run},
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            run.cancel()
            raise
        finally:
            watch.cancel()
            answered.cancel()
            run.add_done_callback(lambda t: self._vote_ended(t, vote, settings, audit))
            _BACKGROUND.add(run)  # an audited group's run outlives the response
            run.add_done_callback(_BACKGROUND.discard)
        if run.done() and not run.cancelled() and run.exception() is not None:
            raise run.exception()  # type: ignore[misc]
        if gone.is_set() or not vote.answered.is_set():
            return None
        status, out = vote.response()
        if body.get("stream") and status == 200 and isinstance(out, dict):
            return await stream_vote(send, api.vote_events(out, body), api.stream_done)
        if isinstance(out, dict):
            return await send_json(send, status, out)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out, "more_body": False})


    def _vote_ended(self, run: asyncio.Future, vote: Vote, settings: OrcaSettings,
                    audit: Any) -> None:
        """A vote's samples all ended (an audited group's after its answer): its audit's
        loss to the vote's guard (None, censored, when the run failed)."""
        failed = run.cancelled() or run.exception() is not None
        if failed and not run.cancelled() and vote.answered.is_set():
            logger.warning("orca: audited vote %s failed after its answer: %r", settings.key,
                           run.exception())
        if self.server.reloader is not None:
            self.server.reloader.finished(settings)
        if audit is not None and settings.vote is not None and settings.vote.audited:
            audit.vote_finished(settings.vote, settings.delta, None if failed else vote.loss(),
                                refused=not failed and vote.refused)


async def _watch_disconnect(receive: Callable, gone: asyncio.Event) -> None:
    """Set `gone` when the client disconnects (the samples' `receive`s then report it)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


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


_BACKGROUND: set[asyncio.Future] = set()


async def _finish(req: _Request) -> None:
    try:
        await req.fetch_all()
    finally:
        req.account()
        if req.audit is not None:
            req.audit.finished(req.settings, req.results, req.finish_reasons)
        if req.server.reloader is not None:
            req.server.reloader.finished(req.settings)
