"""The live audit of the vote (`--orca-vote-audit-rate`, orca_serve/live_audit/votes.py) and the
stream of a voted answer (orca_serve/api_server/vote_stream.py), without vLLM: an audited group
against test_voting's fakes of vLLM's route and engine client, the vote guard's reaction and
state file, the SSE chunks, and the statistical property of the vote's bound (repeated
simulation, fixed seed)."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from orca_method.audit.sequence import CensoredAlarm
from orca_method.consensus import Group, outcomes, plurality
from orca_method.outcomes import OnAlarm, Source
from orca_serve.api_server.voting import Vote
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig
from orca_serve.live_audit.journal import Journal, journal_path
from orca_serve.metrics.prometheus import OrcaMetrics
from orca_serve.settings.resolve import OrcaDefaults
from tests.test_consensus import synthetic_groups
from tests.test_voting import MSG, FakeClient, FakeEngine, bundle, fake_chat_route, resolved


def audited_vote(at, answers, *, t_source=Source.BUNDLE):
    """An audited group of 4 against FakeEngine: (the vote, the engine, the response as the
    middleware reads it once `answered` is set, whether the run was still going then)."""
    body, s = resolved({"messages": MSG, "orca": {"samples": 4}})
    s = replace(s, vote=replace(s.vote, audited=True, t_source=t_source))
    eng = FakeEngine(at, answers)
    v = Vote(s, eng, completions=False, end_tag="</think>")

    async def go():
        run = asyncio.ensure_future(v.run(body, eng.launch))
        await v.answered.wait()
        early = v.response(), not run.done()
        await run
        return early

    (status, out), running = asyncio.run(go())
    assert status == 200
    return v, eng, out, running


def test_an_audited_group_answers_when_settled_and_runs_every_sample_to_its_end():
    # t* = 0: sample 0 settles the vote on "7"; the vote of all four is "3"
    v, eng, out, running = audited_vote([0.01, 0.2, 0.25, 0.3], ["7", "3", "3", "3"])
    assert running  # answered while three samples still ran
    vote = out["orca"]["vote"]
    assert vote["answer"] == "7" and vote["audited"] is True and vote["ended"] == "settled"
    assert [s["running"] for s in out["orca"]["samples"]] == [False, True, True, True]
    # the running ones have no result yet: nothing invented (it said ended "full", 0 tokens)
    assert out["orca"]["samples"][1:] == [{"index": i, "running": True} for i in (1, 2, 3)]
    assert out["orca"]["samples"][0]["answer"] == "7" and "error" not in out["orca"]["samples"][0]
    assert eng.aborted == [] and set(eng.finished.values()) == {"stop"}
    assert v.full.answer == "3" and v.loss() == 1.0


def test_an_audited_groups_usage_counts_the_reasoning_of_the_samples_it_sums():
    # answered once sample 0 settled the vote: the others still run, their tokens unknown
    _, _, out, running = audited_vote([0.01, 0.2, 0.25, 0.3], ["7", "3", "3", "3"])
    assert running and out["usage"]["completion_tokens"] == 10
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 10}


class SlowFetch(FakeEngine):
    """FakeEngine whose fetch of the results of samples `slow` waits for `release`."""

    def __init__(self, at, answers, slow):
        super().__init__(at, answers)
        self.slow, self.fetching, self.release = slow, asyncio.Event(), asyncio.Event()

    async def results(self, keys):
        if any(int(k.rsplit("-s", 1)[1]) in self.slow for k in keys):
            self.fetching.set()
            await self.release.wait()
        return await super().results(keys)


def test_a_sample_whose_result_is_on_its_way_when_the_group_answers_is_still_running():
    """Sample 1 finishes after sample 0 settled the vote, and the answer goes out while its
    result is being fetched (the soak test's audited groups under load: 18 of 200 groups had
    such a sample). It is reported as running: before, it was reported finished, outside the
    vote, with the engine error "no orca result" it never had, and its tokens in `usage`."""
    body, s = resolved({"messages": MSG, "orca": {"samples": 4}})
    s = replace(s, vote=replace(s.vote, audited=True))
    eng = SlowFetch([0.01, 0.05, 1, 1], ["7", "3", "3", "3"], slow={1})
    v = Vote(s, eng, completions=False, end_tag="</think>")

    async def go():
        run = asyncio.ensure_future(v.run(body, eng.launch))
        await v.answered.wait()
        await eng.fetching.wait()  # sample 1's response is in, its result not yet
        answer = v.response()
        eng.release.set()
        await run
        return answer

    status, out = asyncio.run(go())
    assert status == 200 and out["orca"]["vote"]["answer"] == "7"
    assert out["orca"]["samples"][1:] == [{"index": i, "running": True} for i in (1, 2, 3)]
    assert not any("error" in r for r in out["orca"]["samples"])
    assert out["usage"]["completion_tokens"] == 10  # sample 0's alone
    assert v.samples[1].result is not None and v.full.answer == "3"


def test_an_audited_group_whose_vote_holds_has_loss_zero():
    v, eng, _, _ = audited_vote([0.01, 0.2, 0.25, 0.3], ["7", "7", "3", "3"])  # tie: sample 0's
    assert eng.aborted == [] and v.loss() == 0.0


def test_a_fallback_group_waits_for_every_sample_but_still_measures_t_star():
    v, eng, out, running = audited_vote([0.01, 0.2, 0.25, 0.3], ["7", "3", "3", "3"],
                                        t_source=Source.FALLBACK)
    assert not running and eng.aborted == []
    vote = out["orca"]["vote"]
    assert vote["answer"] == "3" and vote["ended"] == "all_finished"
    assert vote["t_source"] == "fallback" and vote["t"] == 0.0
    assert v.early.answer == "7" and v.loss() == 1.0  # what t* would have answered


def test_a_group_with_a_failed_sample_is_censored():
    body, s = resolved({"messages": MSG, "orca": {"samples": 4}})
    s = replace(s, vote=replace(s.vote, audited=True))
    eng = FakeEngine([0.01, 0.2, 0.25, 0.3], ["7"] * 4)

    async def launch(sample, raw):
        if sample.index == 2:  # fails after the vote settled on sample 0
            await asyncio.sleep(0.1)
            return 500, b"{}"
        return await eng.launch(sample, raw)

    v = Vote(s, eng, completions=False, end_tag="</think>")
    asyncio.run(v.run(body, launch))
    assert v.verdict.answer == "7" and v.loss() is None
    assert len(eng.aborted) == 2  # samples 1 and 3: their vote cannot be known any more


# ---------------------------------------------------------------------- the guard and its state


def vote_audit(tmp_path=None, **kw):
    """(the bundle, a live audit of it: its events journalled in `tmp_path` when given)."""
    b = bundle()
    config = AuditConfig(seed=0, directory=tmp_path, **kw)
    journal = None if tmp_path is None else Journal(journal_path(tmp_path, b.checksum),
                                                    b.checksum)
    return b, LiveAudit(b, config, journal=journal)


def test_admission_picks_the_configured_share_and_skips_votes_without_t_star():
    _, la = vote_audit(vote_rate=0.3)
    va = la.votes
    _, s = resolved({"messages": MSG, "orca": {"samples": 4}})
    picked = [va.admit(s.vote, s.delta).audited for _ in range(2000)]
    assert abs(np.mean(picked) - 0.3) < 3 * math.sqrt(0.3 * 0.7 / 2000)
    _, s3 = resolved({"messages": MSG, "orca": {"samples": 3}})  # t None: maj@3, nothing to audit
    assert va.admit(s3.vote, s3.delta) == s3.vote


@pytest.mark.parametrize("on_alarm, source", [(OnAlarm.FALLBACK, Source.FALLBACK),
                                              (OnAlarm.RECALIBRATE, Source.FALLBACK),
                                              (OnAlarm.REPORT, Source.BUNDLE)])
def test_an_alarm_on_the_vote_error_stops_early_settling_unless_report(on_alarm, source):
    _, la = vote_audit(vote_rate=1.0, on_alarm=on_alarm)
    va = la.votes
    _, s = resolved({"messages": MSG, "orca": {"samples": 4}})
    for _ in range(60):  # every audited vote wrong: the lower bound passes delta_vote = 0.1
        la.vote_finished(s.vote, s.delta, 1.0)
    g = va.guard(s.delta, s.vote.delta_vote)
    assert g.engaged and g.cs.lower > 0.1 and g.source == source
    assert va.admit(s.vote, s.delta).t_source == source
    (row,) = [r for r in va.table()["rows"] if r["delta"] == s.delta]
    assert row["alarm"] and row["n"] == 60 and row["t_source"] == source


def test_no_alarm_while_the_vote_holds_and_censored_groups_widen_the_upper_bound():
    _, la = vote_audit(vote_rate=1.0, on_alarm=OnAlarm.FALLBACK)
    va = la.votes
    _, s = resolved({"messages": MSG, "orca": {"samples": 4}})
    for _ in range(100):
        la.vote_finished(s.vote, s.delta, 0.0)
    g = va.guard(s.delta, s.vote.delta_vote)
    upper = g.cs.upper
    for _ in range(10):
        la.vote_finished(s.vote, s.delta, None)
    assert not g.engaged and g.source == Source.BUNDLE and g.cs.upper > upper
    assert va.counts == {"picked": 0, "measured": 100, "censored": 10, "refused": 0}


@pytest.mark.parametrize("events", [60, 1100])  # 1100: past a snapshot (SNAPSHOT_EVERY)
def test_the_guards_state_survives_a_restart(tmp_path, events):
    """The vote's events are the audit journal's: a restart replays them (or the snapshot that
    carries the vote guards), the alarm included."""
    b, la = vote_audit(tmp_path, vote_rate=1.0, on_alarm=OnAlarm.FALLBACK)
    _, s = resolved({"messages": MSG, "orca": {"samples": 4}})
    for i in range(events):
        la.vote_finished(s.vote, s.delta, 1.0 if i < 60 else None)
    before = la.votes.guard(s.delta, s.vote.delta_vote).row()
    la.state.close()
    _, again = vote_audit(tmp_path, vote_rate=1.0, on_alarm=OnAlarm.FALLBACK)
    g = again.votes.guard(s.delta, s.vote.delta_vote)
    assert g.row() == before and g.cs.n == events and g.engaged and g.source == Source.FALLBACK
    assert g.cs.censored == events - 60  # (the counts are this process's: none yet)
    assert (again.state.replayed < events) == (events > 1000)  # resumed from the snapshot
    again.state.close()
    # under another --orca-on-alarm the journal is replayed (the snapshot was folded under
    # other settings): the same sequence, which only reports
    _, other = vote_audit(tmp_path, vote_rate=1.0, on_alarm=OnAlarm.REPORT)
    g = other.votes.guard(s.delta, s.vote.delta_vote)
    assert g.cs.n == events and g.source == Source.BUNDLE


# ---------------------------------------------------------- through the middleware, no vLLM


def reshaped(route, shape):
    """Another API's route over the fake chat route: its answers reshaped by `shape` (a chat
    completion's JSON -> the API's response)."""

    async def app(scope, receive, send):
        async def shaped(msg):
            if msg["type"] == "http.response.body":
                msg = {**msg, "body": json.dumps(shape(json.loads(msg["body"]))).encode()}
            await send(msg)

        await route(scope, receive, shaped)

    return app


def as_message_route(route):
    """vLLM's Messages route as the fake chat route's answers in Anthropic's shape (vLLM runs a
    message through its chat route: the same X-Request-Id and engine request id)."""

    def message(c: dict) -> dict:
        choice = c["choices"][0]
        return {"id": c["id"], "type": "message", "role": "assistant", "model": "m",
                "content": [{"type": "text", "text": choice["message"]["content"]}],
                "stop_reason": "end_turn" if choice["finish_reason"] == "stop" else None,
                "usage": {"input_tokens": 3, "output_tokens": 7}}

    return reshaped(route, message)


def post(body: dict, audit: LiveAudit | None = None, path="/v1/chat/completions",
         wait_audited: int = 0):
    """POST through the orca middleware over test_voting's fake chat route; with
    `wait_audited`, wait until that many audited groups ended (their samples run on after the
    response)."""
    import httpx

    from orca_serve.api_server.middleware import OrcaMiddleware
    from tests.servers import orca_server

    client, seen = FakeClient(), []
    server = orca_server(bundle(), OrcaDefaults(enabled=True, delta=0.1), engine=client,
                         metrics=OrcaMetrics(CollectorRegistry()), audit=audit)
    route = fake_chat_route(client, seen)
    app = OrcaMiddleware(as_message_route(route) if path == "/v1/messages" else route, server)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            r = await c.post(path, json={"model": "m", **body})
        for _ in range(200):
            if audit is None or sum(audit.votes.counts[k] for k in
                                    ("measured", "censored", "refused")) >= wait_audited:
                break
            await asyncio.sleep(0.01)
        return r

    return asyncio.run(go()), client


def test_a_group_vllm_refuses_is_no_censored_audit():
    """A malformed request (vLLM's 400, e.g. max_tokens 0) ran nothing: counted `refused`,
    outside the vote's risk (it was censored, pushing the upper bound up per client mistake)."""
    audit = LiveAudit(bundle(), AuditConfig(vote_rate=1.0, seed=0))
    for i in range(3):
        r, _ = post({"messages": MSG, "seed": 1, "max_tokens": 0, "orca": {"samples": 4}}, audit,
                    wait_audited=i + 1)
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert audit.votes.counts == {"picked": 3, "measured": 0, "censored": 0, "refused": 3}
    assert all(r["n"] == 0 for r in audit.table()["vote"]["rows"])


def test_the_middleware_audits_a_group_after_answering_it():
    b = bundle()
    audit = LiveAudit(b, AuditConfig(vote_rate=1.0, seed=0))
    # seeds 1..4 answer 1, 0, 1, 0 in that order: t* = 0 answers 1; the vote of all four ties
    # 2-2 and goes to sample 0's answer, 1: loss 0
    r, client = post({"messages": MSG, "seed": 1, "orca": {"samples": 4}}, audit,
                     wait_audited=1)
    out = r.json()
    assert out["orca"]["vote"]["audited"] is True and out["orca"]["vote"]["answer"] == "1"
    assert client.aborted == []
    assert audit.votes.counts == {"picked": 1, "measured": 1, "censored": 0, "refused": 0}
    (row,) = [r for r in audit.table()["vote"]["rows"] if r["n"]]
    assert row["delta"] == 0.1 and row["risk"] == 0.0


def test_a_voted_answer_streams_as_chat_chunks_with_orca_in_the_finishing_chunk():
    r, _ = post({"messages": MSG, "seed": 1, "stream": True,
                 "stream_options": {"include_usage": True}, "orca": {"samples": 4}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "\\boxed{1}"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop"
    assert finish[0]["orca"]["vote"]["answer"] == "1"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4 * 7
    assert chunks[-1]["orca"]["vote"]["k"] == 4


def test_the_messages_api_votes_and_aborts():
    r, client = post({"messages": MSG, "max_tokens": 50, "seed": 1, "orca": {"samples": 4}},
                     path="/v1/messages")
    out = r.json()
    assert r.status_code == 200 and out["type"] == "message"
    assert out["content"] == [{"type": "text", "text": "\\boxed{1}"}]
    vote = out["orca"]["vote"]
    assert vote["answer"] == "1" and vote["ended"] == "settled" and len(client.aborted) == 3
    # the aborted ones say so as on chat (Anthropic's message of an aborted request has none)
    assert [s["finish_reason"] for s in out["orca"]["samples"]] == ["stop"] + ["abort"] * 3
    assert out["usage"] == {"input_tokens": 4 * 3, "output_tokens": 4 * 7}
    # Anthropic's usage has no reasoning-token field: the orca object says it, as for one answer
    spent = sum(x["reasoning_tokens"] for x in out["orca"]["samples"])
    assert out["orca"]["reasoning_tokens"] == spent + 3  # + the last token of 3 aborted mid-thought


# ---------------------------------------------------------------------- the bound, statistically

ROUNDS = 300  # independent audit streams per case
AUDITS = 800  # audited groups per stream


def _pool_losses(t: float, rng: np.random.Generator) -> np.ndarray:
    """[pool] the vote audit's loss of each synthetic group at margin t: the vote settled at t
    differs from the vote of all its (stopped) samples, the reference an audit measures."""
    pool = [Group(finish=g.finish, answers=g.answers, weights=np.ones(len(g.answers)),
                  reference=plurality(g.answers))
            for g in synthetic_groups(4000, rng)]
    loss, _ = outcomes(pool, np.array([t]))
    return loss[0].astype(float)


def _alarms(losses: np.ndarray, delta_vote: float, epsilon: float,
            rng: np.random.Generator) -> np.ndarray:
    """[ROUNDS] whether the vote guard's statistics (the CensoredAlarm VoteAudit builds, at its
    epsilon) ever alarm at delta_vote over AUDITS audited groups drawn i.i.d. from the pool."""
    cs = CensoredAlarm(epsilon, grid_size=201, shape=(ROUNDS,))
    fired = np.zeros(ROUNDS, dtype=bool)
    draws = rng.integers(0, len(losses), size=(AUDITS, ROUNDS))
    for i in range(AUDITS):
        cs.update(losses[draws[i]])
        fired |= cs.alarm(delta_vote)
    return fired


def test_the_vote_bound_false_alarm_rate_and_power():
    """Groups are a pool of synthetic groups (test_consensus's), so the vote error of a margin
    is exact. At the hardest null (delta_vote = the pool's true vote error at t) the guard's
    alarm may fire over the whole stream in at most epsilon / 2 of the streams (Ville's
    inequality over the restarted family; +3 binomial standard errors); at a margin whose true
    vote error is twice delta_vote it must fire within AUDITS groups in >= 90% of them."""
    rng = np.random.default_rng(35)
    _, la = vote_audit(vote_rate=0.1)
    eps = la.votes.epsilon
    null = _pool_losses(0.2, rng)  # ~0.10
    delta_vote = float(null.mean())
    share = _alarms(null, delta_vote, eps, rng).mean()
    assert share <= eps / 2 + 3 * math.sqrt(eps / 2 * (1 - eps / 2) / ROUNDS), share
    wrong = _pool_losses(0.1, rng)  # ~0.24
    assert wrong.mean() >= 2 * delta_vote
    assert _alarms(wrong, delta_vote, eps, rng).mean() >= 0.9


def test_the_vote_audit_needs_no_request_audit_but_a_bundle_and_one_api_server():
    import argparse

    from orca_serve.live_audit.options import add_audit_args, audit_config, check_audit_args

    p = argparse.ArgumentParser()
    add_audit_args(p)
    ns = p.parse_args(["--orca-vote-audit-rate", "0.5", "--orca-on-alarm", "fallback",
                       "--orca-audit-dir", "d"])
    check_audit_args(ns, has_bundle=True)  # acting on the vote's alarm needs no request audit
    assert audit_config(ns, bundle()).vote_rate == 0.5
    fleet = p.parse_args(["--orca-vote-audit-rate", "0.5", "--orca-audit-store",
                          "redis://h:6379/0"])
    check_audit_args(fleet, has_bundle=True)  # the vote's journal on the fleet's store
    with pytest.raises(ValueError, match="needs --calib"):
        check_audit_args(ns, has_bundle=False)
    ns.api_server_count = 2
    with pytest.raises(ValueError, match="one API server"):
        check_audit_args(ns, has_bundle=True)


def test_the_vote_audit_metrics():
    from orca_serve.live_audit.collector import AuditCollector

    b = bundle()
    audit = LiveAudit(b, AuditConfig(vote_rate=1.0, seed=0, on_alarm=OnAlarm.FALLBACK))
    _, s = resolved({"messages": MSG, "orca": {"samples": 4}})
    for _ in range(60):
        audit.vote_finished(s.vote, s.delta, 1.0)
    reg = CollectorRegistry()
    reg.register(AuditCollector(lambda: audit, "toy"))
    labels = {"model_name": "toy", "delta": "0.1", "delta_vote": "0.1"}
    g = audit.votes.guard(s.delta, s.vote.delta_vote)
    assert reg.get_sample_value("orca_vote_audit_groups_total",
                                {"model_name": "toy", "state": "measured"}) == 60
    assert reg.get_sample_value("orca_vote_error", labels) == 1.0
    assert reg.get_sample_value("orca_vote_error_upper", labels) == g.cs.upper
    assert reg.get_sample_value("orca_vote_alarm", labels) == 1.0
    assert reg.get_sample_value("orca_vote_fallback", labels) == 1.0
    audit.retire()  # a hot reload replaced it: its groups still running are not counted
    audit.vote_finished(s.vote, s.delta, 0.0)
    assert audit.votes.counts["measured"] == 60
