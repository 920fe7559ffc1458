"""`orca.samples` on a real orca-serve serving the toy reasoner (orca_serve/demo/model), with a
bundle of its own: the shipped toy bundle plus a consensus block certified on small synthetic
groups (tests/bundles.py `with_consensus`: t* = 0, the first finished sample decides, so the
samples still running then are aborted); the server is conftest's `toy_server`, shared with
test_server_gate_alarm. Real vLLM engine, real HTTP, the OpenAI client."""

from __future__ import annotations

import os
import random
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.vllm

from orca_demo.toy.tasks import extract_answer, make_problem
from orca_method.bundle import load_bundle
from tests.bundles import with_consensus, write_bundle
from tests.conftest import TOY_VOTE_K as K
from tests.serving import Server, orca_of, orca_serve_cmd

DEMO = Path(__file__).parents[1] / "orca_serve" / "demo"


ADMIN_KEY_ENV, ADMIN_KEY = "ORCA_TEST_SAMPLES_ADMIN_KEY", "samples-test-key"


def samples_bundle(path: Path, waves: list[int] | None = None,
                   cap_max: float | None = None) -> Path:
    """The toy bundle plus a consensus block for K samples (t* = 0; with `cap_max`, the
    confidence clause: t* = first_t, c* = cap_max) certified for `waves` (None: all at once),
    written to `path`."""
    return write_bundle(with_consensus(load_bundle(DEMO / "bundle.json"), samples=K,
                                       waves=waves, cap_max=cap_max), path)


def start_samples_server(d: Path, *orca_flags: str, waves: list[int] | None = None) -> Server:
    """orca-serve on the toy model with `samples_bundle(waves)` (in its bundle's dtype, as every
    bundle is served), started (not waited for) in `d` with `orca_flags` besides (the plain
    all-at-once server is conftest's shared `toy_server`)."""
    path = samples_bundle(d / "b.json", waves)
    flags = [*orca_flags] + ([] if waves is None else
                             ["--orca-vote-waves", "+".join(map(str, waves))])
    return Server(orca_serve_cmd("--model", str(DEMO / "model"), "--calib", str(path), *flags),
                  d / "serve.log", ["--host", "127.0.0.1", "--enforce-eager",
                                    "--reasoning-parser", "deepseek_r1",
                                    "--served-model-name", "orca-toy-reasoner",
                                    "--seed", "0", "--disable-uvicorn-access-log"])


@pytest.fixture(scope="module")
def srv(toy_server):
    return toy_server.wait()


@pytest.fixture(scope="module")
def waved(tmp_path_factory):
    """Served under --orca-vote-waves 1+1+2, with an admin key: the module's last test reloads
    a bundle of the same schedule into it (a server of its own cost a start, ~13 s of CPU)."""
    os.environ[ADMIN_KEY_ENV] = ADMIN_KEY  # the server process takes it at its start
    try:
        s = start_samples_server(tmp_path_factory.mktemp("waves"), "--orca-admin-key-env",
                                 ADMIN_KEY_ENV, waves=[1, 1, 2])
    finally:
        os.environ.pop(ADMIN_KEY_ENV)
    try:
        yield s.wait()
    finally:
        s.stop()


def questions(n: int) -> list[str]:
    rng = random.Random("samples-test")
    return [make_problem(rng, "in-dist").question for _ in range(n)]


def ask(srv, question: str, orca: dict, **kw):
    return srv.client().chat.completions.create(
        model=srv.client().models.list().data[0].id,
        messages=[{"role": "user", "content": question}], extra_body={"orca": orca},
        max_tokens=kw.pop("max_tokens", 400), temperature=1.0, **kw)


def metric(srv, name: str, **labels: str) -> float:
    """The sum of a metric's samples on /metrics whose labels include `labels` (0: none)."""
    total = 0.0
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] == name and \
                all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_one_voted_answer_and_the_settled_samples_are_aborted_in_the_engine(srv):
    ours_before = metric(srv, "orca_samples_total", event="aborted")
    launched_before = metric(srv, "orca_samples_total", event="launched")
    seen_settled, flagged = False, 0
    for i, q in enumerate(questions(6)):
        r = ask(srv, q, {"samples": K}, seed=100 + i)
        assert len(r.choices) == 1
        o = orca_of(r)
        vote, samples = o["vote"], o["samples"]
        assert vote["k"] == K and len(samples) == K and vote["t"] == 0.0
        voted = samples[vote["sample"]]
        assert voted["in_vote"] and voted["answer"] == vote["answer"]
        assert str(extract_answer(r.choices[0].message.content)) == vote["answer"]
        if vote["ended"] == "settled":
            seen_settled = True
            cut = [s for s in samples if s["aborted"]]
            flagged += len(cut)
            assert cut and all(not s["in_vote"] for s in cut)
            # a sample the vote aborted says so, in chat's terms on every API
            assert all(s["finish_reason"] == "abort" for s in cut), cut
        else:
            assert vote["ended"] == "all_finished" and not any(s["aborted"] for s in samples)
    assert seen_settled, "no vote settled before its samples all finished in 6 prompts"
    assert metric(srv, "orca_samples_total", event="launched") - launched_before == 6 * K
    assert metric(srv, "orca_samples_total", event="aborted") - ours_before == flagged
    assert metric(srv, "vllm:num_requests_running") == 0  # nothing left running in the engine


def test_bad_samples_are_a_clear_400(srv):
    q = questions(1)[0]
    for orca, kw, words in (({"samples": K + 1}, {}, "at most"),
                            ({"samples": 2}, {"n": 2}, "without 'n'"),
                            ({"samples": 0}, {}, ">= 2")):
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
            "model": srv.client().models.list().data[0].id, "max_tokens": 8,
            "messages": [{"role": "user", "content": q}], "orca": orca, **kw})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_n_without_samples_is_as_before(srv):
    r = ask(srv, questions(1)[0], {}, n=2, seed=3, max_tokens=200)
    o = orca_of(r)
    assert len(r.choices) == 2 and "vote" not in o and "samples" not in o
    assert [c["index"] for c in o["choices"]] == [0, 1]


def test_completions_vote_too(srv):
    from orca_demo.toy.train import render_prompt

    q = questions(1)[0]
    r = srv.client().completions.create(
        model=srv.client().models.list().data[0].id, prompt=render_prompt(q) + "<think>", max_tokens=400,
        temperature=1.0, seed=7, extra_body={"orca": {"samples": K}})
    o = (r.model_extra or {})["orca"]
    assert len(r.choices) == 1 and o["vote"]["k"] == K
    assert str(extract_answer(r.choices[0].text)) == o["vote"]["answer"]


def test_the_responses_api_votes_too(srv):
    r = httpx.post(srv.url + "/v1/responses", timeout=300, json={
        "model": srv.client().models.list().data[0].id, "input": questions(1)[0],
        "max_output_tokens": 400, "temperature": 1.0, "orca": {"samples": K}})
    assert r.status_code == 200, r.text
    obj = r.json()
    o = obj["orca"]
    assert obj["object"] == "response" and o["vote"]["k"] == K and len(o["samples"]) == K
    text = "".join(c["text"] for item in obj["output"] if item["type"] == "message"
                   for c in item["content"] if c["type"] == "output_text")
    assert str(extract_answer(text)) == o["vote"]["answer"]
    assert obj["usage"]["output_tokens"] >= sum(s["reasoning_tokens"] for s in o["samples"])


def test_the_responses_api_streams_a_voted_answer(srv):
    """The voted answer as the Responses API's typed events, read by the real openai client
    (raw and through its stream helper, which checks the events' order and identities): the
    event types vLLM's own stream of the same request uses, the answer in
    `response.output_text.delta`, the `orca` object on `response.completed` alone."""
    client, q = srv.client(), questions(1)[0]
    model = client.models.list().data[0].id
    ask_r = dict(model=model, input=q, max_output_tokens=400, temperature=1.0)
    own = {e.type for e in client.responses.create(**ask_r, stream=True)}
    events = list(client.responses.create(**ask_r, stream=True,
                                          extra_body={"orca": {"samples": K}}))
    # vLLM closes its own stream with response.completed whatever the status; ours by status
    closing = {"response.completed", "response.incomplete"}
    assert {e.type for e in events} - closing == own - closing, own ^ {e.type for e in events}
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert ["orca" in (e.response.model_extra or {}) for e in events
            if hasattr(e, "response")] == [False, False, True]
    o = events[-1].response.model_extra["orca"]
    assert o["vote"]["k"] == K and len(o["samples"]) == K
    assert o["vote"]["ended"] in ("settled", "all_finished")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert str(extract_answer(text)) == o["vote"]["answer"]
    with client.responses.stream(**ask_r, extra_body={"orca": {"samples": K}}) as stream:
        final = stream.get_final_response()
    vote = final.model_extra["orca"]["vote"]
    assert str(extract_answer(final.output_text)) == vote["answer"]
    assert final.usage.output_tokens > 0


def test_the_messages_api_streams_a_voted_answer(srv):
    """The voted answer as Anthropic's stream events, read by the real anthropic client: the
    event types vLLM's own stream of the same request uses, the `orca` object on
    `message_delta`."""
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed")
    a = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=300)
    ask_m = dict(model=srv.client().models.list().data[0].id, max_tokens=400,
                 messages=[{"role": "user", "content": questions(1)[0]}])
    with a.messages.stream(**ask_m, extra_body={"temperature": 1.0}) as stream:
        own = {e.type for e in stream}
    with a.messages.stream(**ask_m, extra_body={"temperature": 1.0,
                                                "orca": {"samples": K}}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
           "message_delta", "message_stop"}  # the SDK adds its own (text, thinking) beside
    assert {e.type for e in events} & raw == own & raw, own ^ {e.type for e in events}
    (delta,) = [e for e in events if e.type == "message_delta"]
    o = delta.model_extra["orca"]
    assert o["vote"]["k"] == K and len(o["samples"]) == K
    text = "".join(b.text for b in final.content if b.type == "text")
    assert str(extract_answer(text)) == o["vote"]["answer"]


def test_a_malformed_voted_stream_is_a_clear_400(srv):
    model = srv.client().models.list().data[0].id
    for path, body in (("/v1/responses", {"input": "2+2?", "stream": "yes"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "stream_options": {"include_usage": True}})):
        r = httpx.post(srv.url + path, timeout=30,
                       json={"model": model, **body, "orca": {"samples": K}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in ("stream", "stream_options"), r.text


def test_waves_launch_only_what_the_vote_needs(waved):
    """Served under --orca-vote-waves 1+1+2 with a block certified for it (t* = 0: the first
    finished sample decides): each request runs one sample in the engine, the later waves are
    never launched (so never aborted), and vLLM counts one finished request per vote."""
    launched_before = metric(waved, "orca_samples_total", event="launched")
    engine_before = metric(waved, "vllm:request_success_total")
    for i, q in enumerate(questions(3)):
        r = ask(waved, q, {"samples": K}, seed=300 + i)
        o = orca_of(r)
        vote, samples = o["vote"], o["samples"]
        assert vote["waves"] == [1, 1, 2] and vote["waves_launched"] == 1, vote
        assert vote["sample"] == 0 and vote["settled_after"] == 1 and vote["ended"] == "settled"
        assert samples[1:] == [{"index": j, "launched": False} for j in range(1, K)]
        assert samples[0]["launched"] and not samples[0]["aborted"]
        assert str(extract_answer(r.choices[0].message.content)) == vote["answer"]
    assert metric(waved, "orca_samples_total", event="launched") - launched_before == 3
    assert metric(waved, "vllm:request_success_total") - engine_before == 3


CAP = 120.0  # reasoning tokens: the toy's early stops fall on both sides of it


def test_one_confident_sample_settles_a_served_vote(waved, tmp_path):
    """A version 3 block under --orca-vote-waves 1+1+2 (t* = first_t: no lone sample settles by
    the margin; c* = CAP), reloaded into `waved` (last: its t* = 0 block is gone after): the
    first sample settles the vote alone exactly when the engine reports it stopped early by
    ORCA within CAP reasoning tokens; otherwise the second wave goes out. The engine's own
    report of the sample is what the vote read."""
    path = samples_bundle(tmp_path / "confident.json", [1, 1, 2], cap_max=CAP)
    r = httpx.post(waved.url + "/v1/orca/bundle", json={"path": str(path)}, timeout=180,
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200 and r.json()["changed"], r.text
    alone = waited = 0
    for i, q in enumerate(questions(8)):
        o = orca_of(ask(waved, q, {"samples": K}, seed=500 + i))
        vote, first = o["vote"], o["samples"][0]
        assert vote["confident_tokens"] == CAP and vote["t"] > 1 / K, vote
        sure = first["stopped_early"] and first["reasoning_tokens"] <= CAP
        if sure:
            alone += 1
            assert vote["settled_after"] == 1 and vote["waves_launched"] == 1, (vote, first)
            assert vote["sample"] == 0 and vote["ended"] == "settled"
        else:
            waited += 1
            assert vote["waves_launched"] >= 2, (vote, first)
    assert metric(waved, "vllm:num_requests_running") == 0
    assert alone and waited, f"8 prompts gave {alone} confident first samples, {waited} others"
