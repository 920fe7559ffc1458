"""The live audit of the vote and the stream of a voted answer on a real orca-serve serving the
toy reasoner, with test_server_samples' bundle (the shipped toy bundle plus a consensus block
certified on synthetic groups: t* = 0) and `--orca-vote-audit-rate 0.5`: audited groups abort
nothing, run to their end after their answer and are counted in the vote's bound (GET
/v1/orca/audit, /metrics); a voted answer streams to the real OpenAI client. Real vLLM engine,
real HTTP."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.vllm

from orca_demo.toy.tasks import extract_answer
from tests.serving import orca_of
from tests.test_server_samples import K, ask, metric, questions, samples_server


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("vote-audit")
    with samples_server(d, "--orca-vote-audit-rate", "0.5", "--orca-audit-seed", "0",
                        "--orca-audit-dir", str(d / "audit")) as s:
        yield s


def vote_table(srv) -> dict:
    return httpx.get(srv.url + "/v1/orca/audit", timeout=10).json()["vote"]


def test_audited_groups_run_to_their_end_and_are_counted(srv):
    audited, plain = [], []
    for i, q in enumerate(questions(8)):
        o = orca_of(ask(srv, q, {"samples": K}, seed=200 + i))
        (audited if o["vote"]["audited"] else plain).append(o)
    assert audited and plain, "a rate of 0.5 picked all or none of 8 groups"
    for o in audited:  # nothing aborted: the samples still running went on after the answer
        assert not any(s["aborted"] for s in o["samples"]), o["samples"]
        assert o["vote"]["t_source"] == "bundle"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # their samples end after the responses
        t = vote_table(srv)
        if t["measured"] + t["censored"] == len(audited):
            break
        time.sleep(0.5)
    assert t["picked"] == len(audited) and t["measured"] == len(audited), t
    (row,) = [r for r in t["rows"] if r["n"]]
    assert row["n"] == len(audited) and row["delta_vote"] == 0.1 and row["t"] == 0.0
    assert 0.0 <= row["lower"] <= row["upper"] <= 1.0 and not row["alarm"]
    assert metric(srv, "orca_vote_audit_groups_total", state="measured") == len(audited)
    assert abs(metric(srv, "orca_vote_error_upper", delta="0.1") - row["upper"]) < 1e-9
    assert metric(srv, "vllm:num_requests_running") == 0  # every audited sample ended


def test_a_voted_answer_streams_to_the_openai_client(srv):
    client = srv.client()
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": questions(1)[0]}], max_tokens=400,
        temperature=1.0, seed=7, stream=True, stream_options={"include_usage": True},
        extra_body={"orca": {"samples": K}})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    o = (finish[0].model_extra or {})["orca"]
    assert o["vote"]["k"] == K and len(o["samples"]) == K
    assert str(extract_answer(content)) == o["vote"]["answer"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_a_voted_completion_streams_too(srv):
    from orca_demo.toy.train import render_prompt

    client = srv.client()
    chunks = list(client.completions.create(
        model=client.models.list().data[0].id, prompt=render_prompt(questions(1)[0]) + "<think>",
        max_tokens=400, temperature=1.0, seed=8, stream=True, extra_body={"orca": {"samples": K}}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    o = (chunks[-1].model_extra or {})["orca"]
    assert chunks[-1].choices[0].finish_reason is not None
    assert str(extract_answer(text)) == o["vote"]["answer"]


def test_the_messages_api_votes(srv):
    r = httpx.post(srv.url + "/v1/messages", timeout=120, json={
        "model": srv.client().models.list().data[0].id, "max_tokens": 400, "temperature": 1.0,
        "messages": [{"role": "user", "content": questions(1)[0]}], "orca": {"samples": K}})
    out = r.json()
    assert r.status_code == 200 and out["type"] == "message", r.text
    text = "".join(b.get("text", "") for b in out["content"] if b["type"] == "text")
    assert out["orca"]["vote"]["k"] == K and len(out["orca"]["samples"]) == K
    assert str(extract_answer(text)) == out["orca"]["vote"]["answer"]
    assert out["usage"]["output_tokens"] > 0
