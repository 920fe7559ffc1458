"""One voted answer from k samples (`orca.samples: k`; docs/SERVER.md "One voted answer from k
samples"; the rule and its guarantee: docs/METHOD.md section 14).

The server launches k sample requests through vLLM's own route (each an ORCA request as today,
with its own result key, its own engine request id and, when the client gave a seed, seed + i as
vLLM seeds the choices of `n`; all at once, or in the waves the bundle certified: `waves.py`),
watches them finish, and after each finish asks the consensus rule
(`orca_method.consensus.verdict`) whether the vote of the samples finished so far is settled at
the bundle's certified margin t. Once it is, the samples still running are ABORTED in the engine
(`vllm_compat.engine_client.abort`: their KV cache is freed, they stop taking decode steps), and
the response is the voted sample's, with every sample's `orca` object and how the group ended.

An audited group (`VoteSettings.audited`: the live audit of the vote,
`orca_serve.live_audit.votes`) aborts nothing: `answered` is set once its vote settles (the
middleware answers then), and `run` goes on until every sample has finished, when `loss` says
whether the settled vote differs from the vote of all k. A group whose row's guard acts on an
alarm (`t_source` FALLBACK) settles only when every sample has finished; the vote at t* is still
followed (`early`), so its audits keep measuring t*.

Nothing of vLLM's request handling is re-implemented: each sample is the client's own body, run
by vLLM's app below the orca middleware (its validation, chat template, parsers and response).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Protocol

import numpy as np

from orca_method.answer_probes import answer_after
from orca_method.consensus import Verdict, verdict
from orca_method.outcomes import FinishReason, Source, Weighting
from orca_serve.api_server.apis import CHAT, Api, reasoning_spent
from orca_serve.api_server.asgi import replay_body
from orca_serve.api_server.report import orca_object, reasoning_total
from orca_serve.metrics.prometheus import OrcaMetrics, SampleEvent
from orca_serve.settings.contract import OrcaResult, OrcaSettings
from orca_serve.settings.xargs import encode_settings
from orca_serve.api_server.state import EngineLink
from orca_serve.api_server.waves import Waves
from orca_serve.vllm_compat.engine_client import REQUEST_ID_HEADER, abort

logger = logging.getLogger("orca_serve.api_server.server")

ABORTED_WAIT_S = 30.0  # how long aborted samples get to hand back their (cut) responses


class GroupEnd(StrEnum):
    """How a group ended (the response's `orca.vote.ended`): the rule settled the vote while
    samples were still running (they were aborted), or every sample finished first."""

    SETTLED = "settled"
    ALL_FINISHED = "all_finished"


class Engine(Protocol):
    """What a vote needs of the engine: the samples' orca results and aborting samples."""

    async def results(self, keys: list[str]) -> dict[str, OrcaResult]: ...

    async def abort(self, engine_ids: list[str]) -> None: ...


class LinkedEngine:
    """`Engine` through the server's link: results by the batching fetcher, aborts through
    vLLM's engine client."""

    def __init__(self, link: EngineLink) -> None:
        self.link = link

    async def results(self, keys: list[str]) -> dict[str, OrcaResult]:
        return await self.link.fetcher.get(keys)

    async def abort(self, engine_ids: list[str]) -> None:
        await abort(self.link.client(), engine_ids)


@dataclass
class Sample:
    """One of the k samples: its keys, and what came back."""

    index: int
    key: str  # its orca result key (the engine's `orca_key`)
    engine_id: str  # its request id in the engine (what `abort` takes)
    header_id: str | None = None  # its X-Request-Id (None: the API takes it in the body)
    status: int | None = None
    response: dict[str, Any] | None = None  # its JSON response (status 200)
    raw: bytes = b""
    result: OrcaResult | None = None
    answer: Hashable | None = None
    weight: float = 0.0
    stop_tokens: float = math.inf  # its reasoning tokens where ORCA stopped it early, else inf
    voted: bool = False  # finished before the vote settled: its answer is in the vote
    # its response and result taken in (`Vote.run`): until then an audited group answering
    # reports it as running, since its result may still be on its way from the engine
    taken: bool = False
    launched: bool = False  # sent to the engine (a later wave's is not, once the vote settled)
    aborted: bool = False  # still running when the vote settled: aborted in the engine


def sample_bodies(body: dict[str, Any], settings: OrcaSettings, api: Api,
                  completions: bool = False) -> list[tuple[Sample, bytes]]:
    """The k sample requests of a resolved body: each the client's body as vLLM would run it
    with n = 1, its own orca key in `vllm_xargs`, its own request id (where `api` takes one),
    and seed + i when the client gave a seed."""
    assert settings.vote is not None
    xargs = {k: v for k, v in (body.get("vllm_xargs") or {}).items() if not k.startswith("orca_")}
    seed = body.get("seed")
    out = []
    for i in range(settings.vote.k):
        key = f"{settings.key}-s{i}"
        # one gate decision per prompt feeds the gate alarm (core/gate_alarm.py): the first's
        one = replace(settings, key=key, n=1, vote=None, alarm=i == 0)
        b = {k: v for k, v in body.items() if k not in ("n", "stream", "stream_options")}
        b["vllm_xargs"] = {**xargs, **encode_settings(one)}
        if isinstance(seed, int) and not isinstance(seed, bool):
            b["seed"] = seed + i
        b, engine_id, header = api.sample(b, key, completions)
        out.append((Sample(index=i, key=key, engine_id=engine_id,
                           header_id=key if header else None), json.dumps(b).encode()))
    return out


def vote_of(sample: Sample, api: Api, weighting: Weighting,
            end_tag: str) -> tuple[Hashable | None, float]:
    """(answer, vote weight) of a finished sample, as calibration counted it: the answer written
    after its reasoning (`answer_after`; none when its reasoning never closed), weighted by its
    last smoothed score (score weighting) or 1 (count)."""
    r = sample.result
    closed = r is None or r.reasoning_closed
    answer = answer_after(api.answer_text(sample.response or {}), end_tag) if closed else None
    return answer, weighting.weight(None if r is None else r.last_score)


def early_stop_tokens(sample: Sample) -> float:
    """The confidence clause's signal for a finished sample, as calibration counts it
    (`orca_calibrate.consensus.stopped_groups`): its reasoning tokens when ORCA stopped it early,
    inf when it ran to its end (or reported nothing)."""
    r = sample.result
    return float(r.reasoning_tokens) if r is not None and r.stopped_early else math.inf


async def call_app(app: Callable, scope: dict, body: bytes, request_id: str | None,
                   gone: asyncio.Event) -> tuple[int, bytes]:
    """Run one sample request through `app` (vLLM's routes): its status and body, with
    `request_id` as its X-Request-Id (None: none, the client's dropped). Its `receive` reports a
    disconnect once `gone` is set (the client left: vLLM then aborts it itself)."""
    headers = [(k, v) for k, v in scope.get("headers", [])
               if k.lower() not in (b"content-length", REQUEST_ID_HEADER)]
    headers.append((b"content-length", str(len(body)).encode()))
    if request_id is not None:
        headers.append((REQUEST_ID_HEADER, request_id.encode()))
    sub = dict(scope, headers=headers, state=dict(scope.get("state") or {}))

    async def disconnect() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    status, chunks = 0, []

    async def send(msg: dict) -> None:
        nonlocal status
        if msg["type"] == "http.response.start":
            status = int(msg.get("status") or 0)
        elif msg["type"] == "http.response.body":
            chunks.append(msg.get("body", b""))

    await app(sub, replay_body(body, disconnect), send)
    return status, b"".join(chunks)


class Vote:
    """The fan-out and the vote of one request (`run`); `samples` and `verdict` say what
    happened, `response` builds the answer."""

    def __init__(self, settings: OrcaSettings, engine: Engine, *, api: Api = CHAT,
                 completions: bool = False, end_tag: str = "</think>",
                 metrics: OrcaMetrics | None = None) -> None:
        assert settings.vote is not None
        self.settings = settings
        self.rule = settings.vote
        self.engine = engine
        self.api = api
        self.completions = completions
        self.end_tag = end_tag
        self.metrics = metrics
        self.samples: list[Sample] = []
        self.waves: Waves[tuple[Sample, bytes]] | None = None
        self.verdict: Verdict | None = None  # the vote the response answers (frozen once settled)
        self.settled_after = 0
        self.error: Sample | None = None  # a sample vLLM refused: its answer is the response
        # t* settles groups (else: it is only followed, the group waits for every sample)
        self.acts = self.rule.t is not None and self.rule.t_source == Source.BUNDLE
        self.early: Verdict | None = None  # the first vote settled at t* (acting or not)
        self.full: Verdict | None = None  # the vote of all k, once every sample finished
        self.answered = asyncio.Event()  # the response is known (settled, or a refusal)

    def _decide(self) -> Verdict:
        finished = np.array([s.voted for s in self.samples])  # [k]
        answers = [s.answer for s in self.samples]
        weights = np.array([s.weight for s in self.samples])  # [k]
        stops = np.array([s.stop_tokens for s in self.samples])  # [k]
        # no certified t: the vote waits for every sample (t = 1 only to read the leader)
        v = verdict(answers, weights, finished, 1.0 if self.rule.t is None else self.rule.t,
                    cap=self.rule.confident_tokens, stop_tokens=stops)
        if self.early is None and (v.settled or finished.all()):
            self.early = v
        if finished.all():
            self.full = v
        # every sample in: settled whatever the rule (also when the leading answer is None)
        return replace(v, settled=bool(finished.all()) or (self.acts and v.settled))

    @property
    def refused(self) -> bool:
        """vLLM refused the group's request (a 4xx: its own validation, the same for every
        sample): nothing ran, so an audited group has no vote error, not even an unknown one."""
        return self.error is not None and 400 <= (self.error.status or 0) < 500

    def loss(self) -> float | None:
        """An audited group's vote error: 1 when the vote settled at t* differs from the vote of
        all k samples run to their end, else 0; None when that is unknown (a sample failed, or
        the group was cut short)."""
        if self.error is not None or self.early is None or self.full is None:
            return None
        return float(self.early.answer != self.full.answer)

    async def run(self, body: dict[str, Any],
                  launch: Callable[[Sample, bytes], Any]) -> None:
        """Launch the samples (`launch(sample, body)`: an awaitable of (status, raw body)) wave
        by wave (`self.rule.waves`; one wave: all at once), vote as they finish, abort the rest
        once settled; a wave not yet launched when the vote settles never is. An audited group
        aborts only once a sample failed: after its answer it runs on, every wave, to its end
        (its loss compares the settled vote with the vote of all k)."""
        made = sample_bodies(body, self.settings, self.api, self.completions)
        self.samples = [s for s, _ in made]
        self.waves = Waves(made, self.rule.waves)
        tasks: dict[asyncio.Future, Sample] = {}

        def launch_wave() -> None:
            wave = self.waves.next()
            for s, b in wave:
                s.launched = True
                tasks[asyncio.ensure_future(launch(s, b))] = s
            self._count(SampleEvent.LAUNCHED, len(wave))

        launch_wave()
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                finished = []
                for t in done:
                    s = tasks.pop(t)
                    s.status, s.raw = t.result()
                    finished.append(s)
                await self._fetch(finished)
                for s in sorted(finished, key=lambda s: s.index):
                    if s.status != 200 or s.response is None:
                        self.error = s
                        break
                    s.voted = True
                    s.answer, s.weight = vote_of(s, self.api, self.rule.weighting,
                                                 self.end_tag)
                    s.stop_tokens = early_stop_tokens(s)
                if self.error is None:
                    v = self._decide()
                    if not self.answered.is_set():
                        self.verdict, self.settled_after = v, sum(s.voted for s in self.samples)
                if self.error is not None or self.verdict.settled:
                    self.answered.set()
                if (self.error is not None or (self.verdict.settled and not self.rule.audited)
                        ) and tasks:
                    running = sorted(tasks.values(), key=lambda s: s.index)
                    for s in running:
                        s.aborted = True
                    await self.engine.abort([s.engine_id for s in running])
                    self._count(SampleEvent.ABORTED, len(running))
                    await self._drain(tasks)
                    tasks = {}
                elif (not tasks and self.error is None and self.waves.left
                      and (not self.verdict.settled or self.rule.audited)):
                    launch_wave()  # the waves so far have finished and left the vote open
        finally:
            for t in tasks:
                t.cancel()
            await self._fetch([s for s in self.samples if s.launched and s.result is None])
            self._count(SampleEvent.STOPPED,
                        sum(1 for s in self.samples if s.result and s.result.stopped_early))
            if self.metrics is not None:
                for s in self.samples:
                    if s.result is not None:
                        self.metrics.observe(s.result)

    async def _drain(self, tasks: dict[asyncio.Future, Sample]) -> None:
        """Wait for the aborted samples' (cut) responses, so their results are final."""
        done, pending = await asyncio.wait(tasks, timeout=ABORTED_WAIT_S)
        for t in done:
            s = tasks[t]
            s.status, s.raw = t.result()
            s.response = self._json(s.raw) if s.status == 200 else None
        for t in pending:
            logger.warning("orca: aborted sample %s did not end in %.0f s", tasks[t].key,
                           ABORTED_WAIT_S)
            t.cancel()

    async def _fetch(self, samples: list[Sample]) -> None:
        for s in samples:
            if s.response is None and s.status == 200:
                s.response = self._json(s.raw)
        todo = [s for s in samples if s.result is None]
        if todo:
            got = await self.engine.results([s.key for s in todo])
            for s in todo:
                s.result = got.get(s.key)
        for s in samples:
            s.taken = True

    def _count(self, event: SampleEvent, n: int) -> None:
        if self.metrics is not None and n:
            self.metrics.sampled(event, n)

    def response(self) -> tuple[int, dict[str, Any] | bytes]:
        """(status, body): the voted sample's response with every sample's report, or a
        sample's refusal (vLLM's own error, as it answered it)."""
        if self.error is not None:
            return self.error.status or 500, self.error.raw
        v = self.verdict
        assert v is not None and v.settled
        winner = next(s for s in self.samples if s.voted and s.answer == v.answer)
        out = self.api.as_one(copy.deepcopy(winner.response or {}))
        spent = self._usage(out)
        k_settings = replace(self.settings, n=self.rule.k)
        obj = orca_object(k_settings, {i: r for i, r in self._results().items()
                                       if not self._running(self.samples[i])})
        reports = iter(obj.pop("choices"))
        waved = len(self.rule.waves) > 1
        launched = {"launched": True} if waved else {}
        obj["samples"] = []
        for s in self.samples:
            if not s.launched:  # a later wave the settled vote never needed
                obj["samples"].append({"index": s.index, "launched": False})
            elif self._running(s):  # nothing to report yet: no result, no finish, no answer
                obj["samples"].append({"index": s.index, "running": True, **launched})
            else:
                rep = next(reports)
                # an aborted sample's own word differs by API (chat `abort`, Messages none,
                # Responses `stop`: vLLM 0.32 says `completed` for an aborted response)
                reason = (FinishReason.ABORT if s.aborted
                          else self.api.finish_reason(s.response or {}))
                rep.update(finish_reason=reason, answer=s.answer, in_vote=s.voted,
                           aborted=s.aborted, **launched)
                if self.rule.audited:
                    rep["running"] = False
                obj["samples"].append(rep)
        obj["vote"] = {"k": self.rule.k, "answer": v.answer, "sample": winner.index,
                       "settled_after": self.settled_after,
                       "ended": GroupEnd.SETTLED if any(s.aborted for s in self.samples)
                       or v.running else GroupEnd.ALL_FINISHED,
                       "margin": v.margin, "t": self.rule.t, "delta_vote": self.rule.delta_vote,
                       "weighting": self.rule.weighting, "audited": self.rule.audited,
                       # what settled it; none without a t (maj@k of every sample)
                       "t_source": None if self.rule.t is None else self.rule.t_source}
        if self.rule.confident_tokens is not None:  # the confidence clause (version 3 block)
            obj["vote"]["confident_tokens"] = self.rule.confident_tokens
        if waved:
            obj["vote"] |= {"waves": list(self.rule.waves),
                            "waves_launched": self.waves.launched if self.waves else 0}
        if self.api.usage_details is None and spent is not None:
            obj["reasoning_tokens"] = spent  # where a usage without the field tells it (Messages)
        out["orca"] = obj
        return 200, out

    def _usage(self, out: dict[str, Any]) -> int | None:
        """Usage summed over every sample that answered (what the engine ran), and the
        reasoning tokens the engine generated over the same samples (returned): an audited
        group answers while some still run, and with their missing results counted the total
        was vLLM's own count of the voted sample alone (0 under a template that opens `<think>`
        in the prompt) beside completion tokens of several."""
        usage: dict[str, Any] = {}
        for s in self.samples:
            if self._running(s):
                continue
            u = dict((s.response or {}).get("usage") or {})
            out_name = self.api.usage_output
            if s.result is not None and isinstance(u.get(out_name), int):
                # an aborted sample's response can miss the tokens the engine generated after
                # its last output reached this server and before the abort took hold; the
                # engine's own reasoning count has them: at least that many were generated
                extra = max(0, reasoning_spent(s.result) - u[out_name])
                u[out_name] += extra
                if isinstance(u.get("total_tokens"), int):
                    u["total_tokens"] += extra
            for name in self.api.usage_counts:
                if isinstance(u.get(name), int):
                    usage[name] = usage.get(name, 0) + u[name]
        answered = {s.index: s.result for s in self.samples
                    if s.response is not None and not self._running(s)}
        spent = reasoning_total(replace(self.settings, n=self.rule.k), answered)
        if spent is not None and self.api.usage_details is not None:
            usage[self.api.usage_details] = {"reasoning_tokens": spent}
        if usage:
            out["usage"] = {**(out.get("usage") or {}), **usage}
        return spent

    def _running(self, s: Sample) -> bool:
        """An audited group's sample still running when its answer goes out (it runs on to its
        end, for the audit's full vote): the engine has no result of it to report yet. One
        whose response came in while its result was being fetched counts as running too: the
        answer goes out while `run` waits for that fetch, and reporting it then gave it an
        engine error it never had ("no orca result") and no vote."""
        return self.rule.audited and s.launched and not s.taken

    def _results(self) -> dict[int, OrcaResult | None]:
        """The launched samples' results, by sample index."""
        return {s.index: s.result for s in self.samples if s.launched}

    def _json(self, raw: bytes) -> dict[str, Any] | None:
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return obj if self.api.is_response(obj) else None
