"""`orca.samples` without vLLM: its settings (resolve's refusals, and `n` untouched without it),
and the fan-out and vote (`orca_serve.api_server.voting.Vote`) against a small fake of vLLM's
route and of the engine client, whose samples finish at set times unless aborted."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace

import pytest

from orca_serve.api_server.apis import APIS, CHAT, RESPONSES_PATH
from orca_method.bundle import BundleError
from orca_serve.api_server.voting import Vote, call_app, sample_bodies
from orca_serve.checks.bundle import check_vote_waves
from orca_serve.metrics.prometheus import OrcaMetrics, SampleEvent
from orca_serve.settings.contract import XARG_KEY, XARG_LAM, Policy
from orca_serve.settings.field import OrcaRequestError
from orca_serve.settings.resolve import OrcaDefaults, resolve
from tests.bundles import small_bundle, with_consensus
from tests.servers import orca_result

MSG = [{"role": "user", "content": "2+2?"}]


def bundle(**kw):
    return with_consensus(small_bundle(), **kw)


def resolved(body, b=None):
    b = bundle() if b is None else b
    return resolve(body, OrcaDefaults(enabled=True, delta=0.1), b)


# ----------------------------------------------------------------------------- settings


def test_samples_resolve_to_the_bundles_certified_row():
    body, s = resolved({"messages": MSG, "orca": {"samples": 4}})
    assert s.vote is not None and s.vote.k == 4 and s.vote.t == 0.0
    assert s.vote.delta_vote == 0.1 and s.vote.weighting == "count"
    assert "orca" not in body and body["vllm_xargs"][XARG_KEY] == s.key


def test_fewer_samples_than_certified_run_to_their_end():
    _, s = resolved({"messages": MSG, "orca": {"samples": 3}})
    assert s.vote.t is None and math.isinf(s.lam)  # no certified t: maj@3 of full samples


@pytest.mark.parametrize("body, param, words", [
    ({"orca": {"samples": 5}}, "orca.samples", "groups of 4 samples at most"),
    ({"orca": {"samples": 1}}, "orca.samples", ">= 2"),
    ({"orca": {"samples": 2.0}}, "orca.samples", "integer"),
    ({"orca": {"samples": 4}, "n": 2}, "n", "without 'n'"),
    ({"orca": {"samples": 4, "enabled": False}}, "orca.samples", "needs orca enabled"),
    ({"orca": {"samples": 4, "delta": 0.05}}, None, None),  # a row exists for 0.05
    # nothing certified to vote on (a probe: `stop` settled on a null answer, 3 votes of 4)
    ({"orca": {"samples": 4, "policy": "stop"}}, "orca.policy", "policy 'stop' gives none"),
    ({"orca": {"samples": 4, "policy": "shadow"}}, "orca.policy", "'shadow' never stops"),
    ({"orca": {"samples": 4, "answer_budget": 0}}, "orca.answer_budget", "budget of 0"),
    ({"orca": {"samples": 4, "answer_budget": 8}}, None, None),
])
def test_bad_samples_are_refused_clearly(body, param, words):
    body = {"messages": MSG, **body}
    if param is None:
        assert resolved(body)[1].vote.k == 4
        return
    with pytest.raises(OrcaRequestError) as e:
        resolved(body)
    assert e.value.param == param and words in e.value.message


@pytest.mark.parametrize("effort", ["xhigh", "max"])
def test_samples_with_an_effort_that_switches_orca_off_are_refused_naming_it(effort):
    body = {"messages": MSG, "orca": {"samples": 4}}
    with pytest.raises(OrcaRequestError) as e:
        resolve(body, OrcaDefaults(enabled=True, delta=0.1), bundle(), effort=effort)
    assert e.value.param == "orca.samples"
    assert f"reasoning effort '{effort}'" in e.value.message
    assert '"enabled": true' in e.value.message
    on = {**body, "orca": {"samples": 4, "enabled": True}}  # what the message advises
    assert resolve(on, OrcaDefaults(enabled=True, delta=0.1), bundle(),
                   effort=effort)[1].vote.k == 4


def test_samples_under_a_servers_policy_that_gives_no_answer_are_refused_naming_it():
    with pytest.raises(OrcaRequestError) as e:
        resolve({"messages": MSG, "orca": {"samples": 4}},
                OrcaDefaults(enabled=True, delta=0.1, policy=Policy.STOP), bundle())
    assert e.value.param == "orca.samples" and "(this server's --orca-policy)" in e.value.message
    body = {"messages": MSG, "orca": {"samples": 4, "policy": "answer"}}  # what it advises
    assert resolve(body, OrcaDefaults(enabled=True, delta=0.1, policy=Policy.STOP),
                   bundle())[1].vote.k == 4


def test_samples_with_an_explicit_give_up_are_refused():
    """A vote's samples never give up: the give-up asked for was dropped without a word."""
    from tests.bundles import with_give_up

    two_sided = with_consensus(with_give_up(small_bundle(), [(0.1, 0.3)]))
    with pytest.raises(OrcaRequestError) as e:
        resolved({"messages": MSG, "orca": {"samples": 4, "give_up": {"delta": 0.1}}}, two_sided)
    assert e.value.param == "orca.give_up" and "never give up" in e.value.message


def test_samples_need_a_consensus_block():
    with pytest.raises(OrcaRequestError, match="no consensus block") as e:
        resolved({"messages": MSG, "orca": {"samples": 2}}, small_bundle())
    assert e.value.param == "orca.samples"


def test_n_without_samples_resolves_exactly_as_before():
    body = {"messages": MSG, "n": 3, "seed": 5}
    with_block, s1 = resolved(body)
    without, s2 = resolved(body, small_bundle())
    assert s1.vote is None and s1.n == 3
    strip = lambda b: {**b, "vllm_xargs": {k: v for k, v in b["vllm_xargs"].items()
                                           if k not in (XARG_KEY, "orca_bundle")}}
    assert strip(with_block) == strip(without)


def test_each_sample_is_the_clients_body_with_its_own_key_and_seed():
    body, s = resolved({"messages": MSG, "orca": {"samples": 4}, "seed": 10, "max_tokens": 9})
    made = sample_bodies(body, s, CHAT)
    bodies = [json.loads(b) for _, b in made]
    assert [b["seed"] for b in bodies] == [10, 11, 12, 13]
    assert len({b["vllm_xargs"][XARG_KEY] for b in bodies}) == 4
    assert all(b["max_tokens"] == 9 and "n" not in b and b["vllm_xargs"][XARG_LAM] == 0.8
               for b in bodies)


# ----------------------------------------------------------------------------- the vote


class FakeEngine:
    """Samples that finish at `at[i]` seconds with `answers[i]` unless aborted first (then at
    once, finish_reason abort: what vLLM's abort does to a running request). An aborted
    sample's result counts its response's tokens but the last (which has no hidden state), plus
    `late` the engine generated after the last output reached the server."""

    def __init__(self, at, answers, scores=None, completions=False, late=0):
        self.at, self.answers, self.late = at, answers, late
        self.scores = scores or [0.9] * len(at)
        self.completions = completions
        self.aborted: list[str] = []
        self.events: dict[str, asyncio.Event] = {}
        self.finished: dict[str, str] = {}

    async def launch(self, sample, body):
        eid = sample.engine_id
        ev = self.events.setdefault(eid, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), self.at[sample.index])
            reason = "abort"
        except TimeoutError:
            reason = "stop"
        self.finished[sample.key] = reason
        i = sample.index
        content = "" if reason == "abort" else f"The answer is \\boxed{{{self.answers[i]}}}."
        return 200, json.dumps({"id": sample.key, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content},
             "finish_reason": reason}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 10 * (i + 1),
                      "total_tokens": 5 + 10 * (i + 1)}}).encode()

    async def results(self, keys):
        out = {}
        for k in keys:
            i = int(k.rsplit("-s", 1)[1])
            done = self.finished.get(k) == "stop"
            out[k] = orca_result(index=0, last_score=self.scores[i], reasoning_closed=done,
                                 reasoning_tokens=10 * (i + 1) + (0 if done else self.late - 1),
                                 stopped_early=i % 2 == 0)
        return out

    async def abort(self, ids):
        self.aborted += ids
        for eid in ids:
            self.events.setdefault(eid, asyncio.Event()).set()


def voted(at, answers, k=4, weighting="count", samples=None, cap_max=None, **kw):
    b = bundle(samples=samples or k, weighting=weighting, cap_max=cap_max)
    body, s = resolved({"messages": MSG, "orca": {"samples": k}}, b)
    eng = FakeEngine(at, answers, **kw)
    metrics = OrcaMetrics(registry=__import__("prometheus_client").CollectorRegistry())
    v = Vote(s, eng, completions=False, end_tag="</think>", metrics=metrics)
    asyncio.run(v.run(body, eng.launch))
    return v, eng, metrics


def count(metrics, event):
    return metrics.samples.labels(event=event, model_name="")._value.get()


def test_the_vote_settles_at_the_first_finish_and_aborts_the_rest():
    v, eng, metrics = voted([0.01, 5, 5, 5], ["7", "3", "3", "3"])  # t* = 0
    status, out = v.response()
    assert status == 200 and out["choices"][0]["message"]["content"].endswith("{7}.")
    vote = out["orca"]["vote"]
    assert vote == {"k": 4, "answer": "7", "sample": 0, "settled_after": 1, "ended": "settled",
                    "margin": 1.0, "t": 0.0, "delta_vote": 0.1, "weighting": "count",
                    "audited": False, "t_source": "bundle"}
    assert eng.aborted == [f"chatcmpl-{s.key}" for s in v.samples[1:]]  # vLLM's engine ids
    samples = out["orca"]["samples"]
    assert [x["aborted"] for x in samples] == [False, True, True, True]
    assert [x["finish_reason"] for x in samples] == ["stop", "abort", "abort", "abort"]
    assert [x["in_vote"] for x in samples] == [True, False, False, False]
    assert out["usage"]["completion_tokens"] == 10 + 20 + 30 + 40  # what the engine ran
    assert count(metrics, SampleEvent.LAUNCHED) == 4 and count(metrics, SampleEvent.ABORTED) == 3
    assert count(metrics, SampleEvent.STOPPED) == 2  # samples 0 and 2 stopped early (the fake)


def test_usage_counts_at_least_the_reasoning_the_engine_ran_for_an_aborted_sample():
    """An aborted sample's response can miss the tokens the engine generated between its last
    output reaching the server and the abort (seen once in CI: output_tokens 548 below the
    samples' summed reasoning_tokens 592): its usage counts at least its reasoning, so the
    reasoning tokens never exceed the output tokens."""
    _, out = voted([0.01, 5, 5, 5], ["7", "3", "3", "3"], late=5)[0].response()
    usage = out["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 10 + 25 + 35 + 45
    assert usage["completion_tokens"] == 10 + 25 + 35 + 45
    assert usage["total_tokens"] == 4 * 5 + usage["completion_tokens"]
    assert usage["prompt_tokens"] == 4 * 5


def test_without_a_certified_t_every_sample_votes_and_none_is_aborted():
    v, eng, _ = voted([0.01, 0.02, 0.03], ["7", "3", "3"], k=3, samples=4)  # t None: maj@3
    status, out = v.response()
    assert eng.aborted == [] and out["orca"]["vote"]["ended"] == "all_finished"
    assert out["orca"]["vote"]["answer"] == "3" and out["orca"]["vote"]["sample"] == 1
    assert out["orca"]["vote"]["settled_after"] == 3 and out["orca"]["vote"]["t"] is None


def test_one_confident_sample_settles_the_vote_alone():
    """A version 3 block (t* = first_t = 0.34 for k = 4, c* = 20 tokens): no lone sample settles
    by the margin (1 is not > 0.34 * 3), but sample 0, stopped early by ORCA within 10 reasoning
    tokens (the fake's), settles the vote alone and the rest are aborted; sample 2, stopped at 30
    tokens, above the cap, does not: the vote waits for samples 1 and 3 (which ran to their end),
    whose agreement settles it by the margin before sample 0 finishes."""
    b = bundle(cap_max=20.0)
    assert b.consensus.version == 3 and {r.confident_tokens for r in b.consensus.rows} == {20.0}
    _, s = resolved({"messages": MSG, "orca": {"samples": 4}}, b)
    assert s.vote.t == pytest.approx(0.34) and s.vote.confident_tokens == 20.0
    v, eng, _ = voted([0.01, 5, 5, 5], ["7", "3", "3", "3"], cap_max=20.0)
    vote = v.response()[1]["orca"]["vote"]
    assert vote["answer"] == "7" and vote["settled_after"] == 1 and vote["confident_tokens"] == 20.0
    assert len(eng.aborted) == 3 and v.samples[0].stop_tokens == 10.0
    v, eng, _ = voted([0.5, 0.1, 0.01, 0.1], ["7", "3", "3", "3"], cap_max=20.0)
    assert v.samples[2].stop_tokens == 30.0 and v.settled_after == 3
    assert v.verdict.answer == "3" and v.samples[1].stop_tokens == math.inf  # ran to its end
    assert eng.aborted == [v.samples[0].engine_id]


def test_score_weights_are_the_samples_last_scores():
    v, _, _ = voted([0.01, 5, 5, 5], ["7", "3", "3", "3"], weighting="score",
                    scores=[0.25, 0.9, 0.9, 0.9])
    assert v.samples[0].weight == 0.25 and v.response()[1]["orca"]["vote"]["margin"] == 0.25


def test_waves_launch_the_next_wave_only_while_the_vote_is_open():
    """Waves 1+1+2 at t* = 0 with score weights: sample 0 votes with weight 0 (nothing
    settled), so wave 2 goes out; sample 1 settles the vote, and wave 3 is never launched."""
    b = bundle(weighting="score", waves=[1, 1, 2])
    body, s = resolved({"messages": MSG, "orca": {"samples": 4}}, b)
    assert s.vote.waves == (1, 1, 2) and s.vote.t == 0.0
    eng = FakeEngine([0.01, 0.01, 0.01, 0.01], ["7", "3", "3", "3"], scores=[0.0, 0.9, 0.9, 0.9])
    metrics = OrcaMetrics(registry=__import__("prometheus_client").CollectorRegistry())
    v = Vote(s, eng, completions=False, end_tag="</think>", metrics=metrics)
    asyncio.run(v.run(body, eng.launch))
    status, out = v.response()
    assert sorted(eng.finished) == [v.samples[0].key, v.samples[1].key] and eng.aborted == []
    vote = out["orca"]["vote"]
    assert vote["answer"] == "3" and vote["sample"] == 1 and vote["ended"] == "settled"
    assert vote["waves"] == [1, 1, 2] and vote["waves_launched"] == 2
    samples = out["orca"]["samples"]
    assert samples[2:] == [{"index": 2, "launched": False}, {"index": 3, "launched": False}]
    assert [x["launched"] for x in samples[:2]] == [True, True]
    assert out["usage"]["completion_tokens"] == 10 + 20  # only what was launched
    assert count(metrics, SampleEvent.LAUNCHED) == 2 and count(metrics, SampleEvent.ABORTED) == 0


def test_an_audited_group_in_waves_launches_every_wave_to_know_the_whole_vote():
    """The same waves and answers as above, audited: the answer is still sample 1's settled
    vote, but the group goes on to launch wave 3, since its loss compares that vote with the
    vote of all k samples; nothing is aborted."""
    b = bundle(weighting="score", waves=[1, 1, 2])
    body, s = resolved({"messages": MSG, "orca": {"samples": 4}}, b)
    s = replace(s, vote=replace(s.vote, audited=True))
    eng = FakeEngine([0.01, 0.01, 0.01, 0.01], ["7", "3", "3", "3"], scores=[0.0, 0.9, 0.9, 0.9])
    v = Vote(s, eng, completions=False, end_tag="</think>")
    asyncio.run(v.run(body, eng.launch))
    assert sorted(eng.finished) == sorted(x.key for x in v.samples) and eng.aborted == []
    assert v.waves.launched == 3 and v.verdict.answer == "3" and v.settled_after == 2
    assert v.full is not None and v.full.answer == "3" and v.loss() == 0.0


def test_a_group_below_the_blocks_k_says_no_t_settled_it():
    v, _, _ = voted([0.01, 0.02, 0.03], ["7", "3", "3"], k=3, samples=4)  # t certified for 4
    vote = v.response()[1]["orca"]["vote"]
    assert vote["t"] is None and vote["t_source"] is None and vote["ended"] == "all_finished"


def test_a_wave_bundle_without_a_certified_t_launches_all_at_once():
    b = bundle(waves=[1, 1, 2], samples=4)
    _, s = resolved({"messages": MSG, "orca": {"samples": 3}}, b)  # k below the block's
    assert s.vote.t is None and s.vote.waves == (3,)


def test_a_schedule_the_bundle_does_not_certify_is_refused():
    waved, at_once = bundle(waves=[1, 1, 2]), bundle()
    check_vote_waves(waved, (1, 1, 2))
    check_vote_waves(at_once, None)
    check_vote_waves(small_bundle(), (1, 1, 2))  # no block: no orca.samples to serve
    with pytest.raises(BundleError, match="--orca-vote-waves all at once: .* in waves 1\\+1\\+2"):
        check_vote_waves(waved, None)
    with pytest.raises(BundleError, match="--orca-vote-waves 2\\+2: .*launched all at once"):
        check_vote_waves(at_once, (2, 2))
    with pytest.raises(BundleError, match="with --orca-vote-waves 1\\+1\\+2"):
        check_vote_waves(waved, (2, 2))


def test_a_sample_whose_reasoning_never_closed_votes_no_answer():
    class Open(FakeEngine):
        async def results(self, keys):
            got = await super().results(keys)
            return {k: orca_result(index=0, last_score=0.9, reasoning_closed=False)
                    for k in got}

    b = bundle(samples=2)
    body, s = resolved({"messages": MSG, "orca": {"samples": 2}}, b)
    eng = Open([0.01, 0.02], ["7", "7"])
    v = Vote(s, eng, completions=False, end_tag="</think>")
    asyncio.run(v.run(body, eng.launch))
    assert [x.answer for x in v.samples] == [None, None]
    vote = v.response()[1]["orca"]["vote"]  # "no answer" leads: every sample waited for
    assert vote["answer"] is None and vote["ended"] == "all_finished" and eng.aborted == []


def test_a_refused_sample_is_the_response_and_the_others_are_aborted():
    b = bundle()
    body, s = resolved({"messages": MSG, "orca": {"samples": 4}}, b)
    eng = FakeEngine([5, 5, 5, 5], ["7"] * 4)

    async def launch(sample, raw):
        if sample.index == 2:
            return 400, b'{"error": {"message": "no"}}'
        return await eng.launch(sample, raw)

    v = Vote(s, eng, completions=False, end_tag="</think>")
    asyncio.run(v.run(body, launch))
    assert v.response() == (400, b'{"error": {"message": "no"}}')
    assert len(eng.aborted) == 3


def test_call_app_runs_a_sample_through_an_asgi_app_with_its_own_request_id():
    seen = {}

    async def app(scope, receive, send):
        seen["id"] = dict(scope["headers"])[b"x-request-id"]
        seen["body"] = (await receive())["body"]
        seen["next"] = (await receive())["type"]  # after `gone`: the client left
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def go():
        gone = asyncio.Event()
        task = asyncio.ensure_future(call_app(app, {"type": "http", "headers": [
            (b"x-request-id", b"client's"), (b"content-length", b"3")]}, b"abc", "s-1", gone))
        await asyncio.sleep(0.01)
        gone.set()
        return await task

    assert asyncio.run(go()) == (200, b"{}")
    assert seen == {"id": b"s-1", "body": b"abc", "next": "http.disconnect"}


def test_responses_samples_carry_their_request_id_in_the_body():
    body, s = resolved({"input": "2+2?", "orca": {"samples": 2}})
    made = sample_bodies(body, s, APIS[RESPONSES_PATH])
    for sample, raw in made:
        assert json.loads(raw)["request_id"] == sample.key and sample.header_id is None
        assert sample.engine_id == f"{sample.key}_0"
    resp = {"object": "response", "status": "completed", "output": [
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "\\boxed{1}"}]},
        {"type": "message", "content": [{"type": "output_text", "text": "So \\boxed{4}."}]}]}
    assert APIS[RESPONSES_PATH].answer_text(resp) == "So \\boxed{4}."
    assert APIS[RESPONSES_PATH].finish_reason(resp) == "stop"


# ---------------------------------------------------------- through the middleware, no vLLM


class FakeClient:
    """vLLM's engine client as the middleware reaches it: `collective_rpc` for the results and
    `abort` by engine request id, which ends that request's route at once (finish_reason
    abort), as AsyncLLM's abort does."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}
        self.aborts: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        # the plugin forgets a result once fetched
        return [{k: self.results.pop(k) for k in args[0] if k in self.results}]

    async def abort(self, ids):
        self.aborted += list(ids)
        for i in ids:
            self.aborts.setdefault(i, asyncio.Event()).set()


def chat_engine_id(scope: dict, body: dict) -> str:
    """The engine request id vLLM's chat route gives a request (from its X-Request-Id)."""
    return "chatcmpl-" + dict(scope["headers"])[b"x-request-id"].decode()


def fake_chat_route(client: FakeClient, seen: list, engine_id=chat_engine_id):
    """vLLM's chat route: a sample with seed s runs s/100 s and answers s % 2 (so the samples
    of seeds 0..3 finish in order, answering 0, 1, 0, 1) unless aborted first (by its
    `engine_id(scope, body)`)."""

    async def app(scope, receive, send):
        body = json.loads((await receive())["body"])
        seen.append(body)
        if body.get("max_tokens") == 0:  # refused by vLLM's validation, as vLLM answers it
            data = json.dumps({"error": {"message": "max_tokens must be at least 1, got 0.",
                                         "type": "BadRequestError", "code": 400}}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": data})
            return
        eid = engine_id(scope, body)
        ev = client.aborts.setdefault(eid, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), body["seed"] / 100)
            reason, content = "abort", ""
        except TimeoutError:
            reason, content = "stop", f"\\boxed{{{body['seed'] % 2}}}"
        client.results[body["vllm_xargs"]["orca_key"]] = orca_result(
            index=0, last_score=0.9, reasoning_closed=reason == "stop",
            stopped_early=True).to_dict()
        data = json.dumps({"id": eid, "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content},
             "finish_reason": reason}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})

    return app


def post_vote(body: dict, b=None):
    import httpx
    from prometheus_client import CollectorRegistry

    from orca_serve.api_server.middleware import OrcaMiddleware
    from tests.servers import orca_server

    client, seen = FakeClient(), []
    metrics = OrcaMetrics(CollectorRegistry())
    server = orca_server(bundle() if b is None else b, OrcaDefaults(enabled=True, delta=0.1),
                         engine=client, metrics=metrics)
    app = OrcaMiddleware(fake_chat_route(client, seen), server)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            return await c.post("/v1/chat/completions", json={"model": "m", **body})

    return asyncio.run(go()), client, seen, metrics


def test_the_middleware_votes_and_aborts_through_the_engine_client():
    r, client, seen, metrics = post_vote({"messages": MSG, "seed": 1, "orca": {"samples": 4}})
    assert r.status_code == 200
    out = r.json()
    assert [b["seed"] for b in seen] == [1, 2, 3, 4]  # sample 0 first: it answers 1
    assert out["orca"]["vote"]["answer"] == "1" and out["orca"]["vote"]["ended"] == "settled"
    assert len(out["choices"]) == 1 and out["choices"][0]["message"]["content"] == "\\boxed{1}"
    keys = [b["vllm_xargs"]["orca_key"] for b in seen]
    assert client.aborted == [f"chatcmpl-{k}" for k in keys[1:]]  # vLLM's ids for the header
    assert [s["finish_reason"] for s in out["orca"]["samples"]] == ["stop"] + ["abort"] * 3
    assert out["usage"]["completion_tokens"] == 4 * 7
    assert count(metrics, SampleEvent.ABORTED) == 3
    assert not client.results  # every sample's result fetched (the plugin may forget it)
    assert not any("error" in s for s in out["orca"]["samples"])  # each got its result
