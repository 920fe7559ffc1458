"""Judge labels through a real OpenAI-compatible HTTP stub and the real openai client (no vLLM)."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from orca_calibrate.calibrate_cli import main
from orca_calibrate.collect import _label_batch, _problem_fields
from orca_calibrate.job import JobError, load_job
from orca_calibrate.judge import Judge, JudgeError, JudgeSettings, parse_verdict, question_text

KEY_ENV, KEY = "ORCA_TEST_JUDGE_KEY", "sk-test"
TABLE = {"What is 6 * 7?": "42", "Name the capital of France.": "paris"}  # the stub's truth
GARBLE = "garbled"  # a candidate the stub answers with neither yes nor no
PROMPT = re.compile(r"Problem:\n(.*?)\n\n(?:Reference answer: .*?\n\n)?Candidate answer: (.*?)\n\n"
                    r"Is the", re.DOTALL)


def _stub_app(state: SimpleNamespace) -> FastAPI:
    """POST /v1/chat/completions: "yes" iff the candidate is the table's answer to the problem."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return JSONResponse({"error": {"message": "Incorrect API key provided",
                                           "type": "invalid_request_error"}}, status_code=401)
        body = await request.json()
        question, candidate = PROMPT.search(body["messages"][-1]["content"]).groups()
        state.calls.append((question, candidate))
        state.inflight += 1
        state.peak = max(state.peak, state.inflight)
        await asyncio.sleep(0.05)  # lets concurrent requests overlap
        state.inflight -= 1
        if candidate == GARBLE:
            reply = "I cannot tell from this."
        else:
            reply = "Yes." if candidate.strip().lower() == TABLE.get(question) else "no"
        return {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": reply}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return app


@pytest.fixture(scope="module")
def stub():
    state = SimpleNamespace(calls=[], inflight=0, peak=0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_stub_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the stub server did not start"
        time.sleep(0.02)
    state.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    yield state
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def judge(stub, monkeypatch) -> Judge:
    monkeypatch.setenv(KEY_ENV, KEY)
    stub.calls.clear()
    stub.peak = 0
    return Judge(JudgeSettings(base_url=stub.url, model="stub", api_key_env=KEY_ENV))


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def test_parse_verdict() -> None:
    assert parse_verdict("Yes") == 1 and parse_verdict("**No**.") == 0
    assert parse_verdict("<think>is it? no...</think>\nyes") == 1
    assert parse_verdict("The candidate is right: yes") == 1
    for unclear in ("maybe: yes or no", "correct", "", None, "<think>cut off before the verdict"):
        assert parse_verdict(unclear) is None


def test_verdicts_and_cache(judge, stub) -> None:
    q = "What is 6 * 7?"
    steps = [None, "40", "42", " 42", "42.", "42", "40"]
    assert judge.label([(q, "42", steps)]) == [[0, 0, 1, 1, 1, 1, 0]]
    # one call per unique normalised answer ("42", " 42" and "42." are one), none for None
    assert sorted(c for _, c in stub.calls) == ["40", "42"]
    assert judge.label([(q, "42", ["42", "40"])]) == [[1, 0]] and len(stub.calls) == 2
    assert judge.label([(q, "42", [None, None])]) == [[0, 0]] and len(stub.calls) == 2
    assert judge.counts() == {"judge_calls": 2, "judge_unparseable": 0}


def test_concurrent_requests(judge, stub) -> None:
    answers = [str(n) for n in range(30, 50)]
    assert judge.label([("What is 6 * 7?", None, answers)]) == [[int(a == "42") for a in answers]]
    assert len(stub.calls) == 20 and 1 < stub.peak <= 16


def test_unparseable_reply_counts_zero(judge, stub) -> None:
    assert judge.label([("What is 6 * 7?", "42", ["42", GARBLE, GARBLE])]) == [[1, 0, 0]]
    assert judge.unparseable == 1 and judge.calls == 2
    assert judge.example == "I cannot tell from this."


def test_endpoint_errors(stub, monkeypatch) -> None:
    dead = Judge(JudgeSettings(base_url=_dead_url(), model="stub", max_retries=0))
    with pytest.raises(JudgeError, match=r"judge endpoint http://127\.0\.0\.1:\d+/v1 is unreachable"):
        dead.label([("What is 6 * 7?", "42", ["42"])])
    monkeypatch.setenv(KEY_ENV, "sk-wrong")
    wrong = Judge(JudgeSettings(base_url=stub.url, model="stub", api_key_env=KEY_ENV))
    with pytest.raises(JudgeError, match=rf"refused the API key \(HTTP 401\).*\${KEY_ENV}"):
        wrong.check()
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(JudgeError, match=f"{KEY_ENV} .* is not set"):
        Judge(JudgeSettings(base_url=stub.url, model="stub", api_key_env=KEY_ENV))


def test_cli_reports_an_unreachable_judge_in_one_line(tmp_path, capsys) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt": "What is 6 * 7?", "answer": "42"}\n')
    code = main(["collect", "--model", "unused", "--prompts", str(prompts), "--out",
                 str(tmp_path / "out"), "--judge-url", _dead_url(), "--judge-model", "stub"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("orca-calibrate collect: error: judge endpoint") and "unreachable" in err
    assert main(["collect", "--model", "m", "--prompts", str(prompts), "--out", "o",
                 "--judge-url", "http://x/v1"]) == 2
    assert "--judge-url and --judge-model go together" in capsys.readouterr().err


def _generated(text: str, n_steps: int) -> tuple[SimpleNamespace, dict]:
    out = SimpleNamespace(outputs=[SimpleNamespace(text=text, finish_reason="stop",
                                                   token_ids=list(range(20)))])
    return out, {"step_tokens": [2] * n_steps}


def test_collector_records_get_judge_labels(judge, stub) -> None:
    chat = {"id": "a", "answer": 42, "messages": [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "What is 6 * 7?"}]}
    free = {"id": "b", "prompt": "Name the capital of France."}  # no reference answer
    out_a, res_a = _generated("<think>\nx\n</think>\n\\boxed{42}", 5)
    out_b, res_b = _generated("<think>\nx\n</think>\n\\boxed{Lyon}", 3)
    done = [("a", chat, out_a, res_a), ("b", free, out_b, res_b)]
    answers = [{1: "40", 2: "42", 3: " 42 ", 4: "42"}, {0: "Paris", 2: "Lyon"}]
    plain = [_problem_fields(k, rec, out, res, probed)
             for (k, rec, out, res), probed in zip(done, answers)]
    assert _label_batch(done, answers, None) == plain  # no judge: records unchanged
    records = _label_batch(done, answers, judge)
    assert [r["labels"]["judge"] for r in records] == [[0, 0, 1, 1, 1], [1, 1, 0]]
    for r, p in zip(records, plain):  # the other modes are untouched
        assert {m: v for m, v in r["labels"].items() if m != "judge"} == p["labels"]
    assert records[0]["labels"]["supervised"] == [0, 0, 1, 1, 1]
    assert records[1]["labels"]["consistent"] == [0, 0, 1]
    assert sorted(stub.calls) == [("Name the capital of France.", "Lyon"),
                                  ("Name the capital of France.", "Paris"),
                                  ("What is 6 * 7?", "40"), ("What is 6 * 7?", "42")]
    assert question_text(chat) == "What is 6 * 7?"


def test_job_judge_block(tmp_path) -> None:
    j = tmp_path / "job.yaml"
    j.write_text("model: m\nprompts: p.jsonl\nout: o\ntrain: {label_mode: judge}\n"
                 "collect: {judge: {base_url: 'http://h:8001/v1', model: j, api_key_env: K}}\n")
    assert load_job(j)["collect"]["judge"] == JudgeSettings("http://h:8001/v1", "j", "K")
    j.write_text("model: m\nprompts: p.jsonl\nout: o\ncollect: {judge: {base_url: u, modle: j}}\n")
    with pytest.raises(JobError, match=r"judge needs base_url and model.*unknown \['modle'\]"):
        load_job(j)
    j.write_text("model: m\nprompts: p.jsonl\nout: o\ntrain: {label_mode: judge}\n")
    with pytest.raises(JobError, match="label_mode judge needs a collect.judge block"):
        load_job(j)
