"""orca-serve end to end: real server processes on the tiny model, real `openai` client.

One orca server (conftest's `tiny_server`, shared with test_server_apis; bundle whose probe fires
at once: bias 3 -> score ~0.95 from the first step) and one plain vLLM server (vLLM's own
api_server module, for the byte-identity check), started at once; the start-up refusals run
meanwhile.

Bundle table of the orca server (lambda* non-increasing in delta, as the start-up check
requires): delta 0.05 -> never, 0.1 -> lambda 0.99 (never reached), 0.2 -> lambda 0.5 (stops at
step 1); the default delta is 0.2.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.vllm

import openai

from tests.bundles import DELTAS, make_bundle
from tests.serving import (
    COMMON,
    MSG,
    Server,
    orca_of,
    refusals,
    server_model,
)
from tests.tiny_model import HIDDEN


@pytest.fixture(scope="module")
def env(tiny_server, tmp_path_factory):
    return {"dir": tmp_path_factory.mktemp("orca_server"), "model": tiny_server["model"],
            "bundle": tiny_server["bundle"]}


@pytest.fixture(scope="module")
def servers(env, tiny_server):
    """The shared orca server (started by conftest) and a plain vLLM server started now; tests
    wait for the one they need."""
    # plain vLLM itself (not orca-serve without --calib): vLLM's own OpenAI server module
    plain = Server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                    str(env["model"])], env["dir"] / "plain.log", COMMON)
    yield {"orca": tiny_server["server"], "plain": plain}
    plain.stop()


@pytest.fixture(scope="module")
def srv(servers):
    return servers["orca"].wait()


def chat(server: Server, orca: dict | None = None, **kw):
    body = {"orca": orca} if orca is not None else None
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return server.client().chat.completions.create(model=str(server_model(server)), messages=kw.pop(
        "messages", MSG), extra_body=body, **kw)


# -- start-up refusals (run while the servers start) ----------------------------------------------
BAD_FLAGS = {"--orca-delta 2": "must be in (0, 1)", "--orca-policy bogus": "invalid choice",
             "--orca-audit-rate x": "not a number", "--orca-answer-budget": "expected one arg",
             "--orca-effort-map high=2": "'high=2': a delta must be in (0, 1)"}


def test_start_up_refusals_are_one_line(env, servers):
    """Hidden size, an edited table, a delta the bundle has no lambda* for, an unsupported
    speculation method: exit 2 and one line each, through orca-serve's entry function."""
    model = ["--model", str(env["model"]), *COMMON]
    corrupt = json.loads(env["bundle"].read_text())
    corrupt["ltt"]["rows"][0]["lam"] = 0.01  # an edit after calibration
    (env["dir"] / "corrupt.json").write_text(json.dumps(corrupt))
    wrong_hidden = make_bundle(env["dir"] / "wrong_hidden.json", env["model"], hidden=HIDDEN // 2)
    got, _ = refusals({
        "hidden": [*model, "--calib", str(wrong_hidden)],
        "checksum": [*model, "--calib", str(env["dir"] / "corrupt.json")],
        "delta": [*model, "--calib", str(env["bundle"]), "--orca-delta", "0.3"],
        "eagle": [*model, "--calib", str(env["bundle"]),
                  "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
        "notjson": [*model, "--calib", str(env["bundle"]), "--speculative-config", "notjson"],
        **{f"flag {flag}": [*model, "--calib", str(env["bundle"]), *flag.split()]
           for flag in BAD_FLAGS}})
    for name, (code, err) in got.items():
        assert code == 2 and "Traceback" not in err, (name, err[-2000:])
        assert len(err.strip().splitlines()) == 1, (name, err)
    assert "hidden size" in got["hidden"][1] and str(HIDDEN // 2) in got["hidden"][1]
    assert "checksum" in got["checksum"][1]
    assert got["delta"][1].strip() == ("orca-serve: error: --orca-delta 0.3: delta 0.3 has no "
                                       "calibrated lambda* in this bundle; available deltas: "
                                       "0.05, 0.1, 0.2")
    assert got["eagle"][1].strip() == (
        "orca-serve: error: speculative decoding with method 'eagle' is not supported with orca "
        "(tested: ngram, draft_model; set \"method\" in the speculative config)")
    assert "'notjson' is not valid JSON" in got["notjson"][1]
    for flag, why in BAD_FLAGS.items():  # one line (docs/SERVER.md), not argparse's usage
        assert got[f"flag {flag}"][1].startswith(f"orca-serve: error: argument {flag.split()[0]}: "
                                                 f"{why}"), got[f"flag {flag}"][1]


# -- requests ---------------------------------------------------------------------------------
def test_chat_non_streaming_has_orca(srv):
    resp = chat(srv, {"delta": 0.05, "policy": "answer"})
    o = orca_of(resp)
    assert o["enabled"] is True and o["policy"] == "answer" and o["delta"] == 0.05
    assert o["lambda"] is None and o["stopped_early"] is False and o["stop_step"] is None
    assert o["steps_scored"] >= 1 and 0 < o["last_score"] < 1
    assert o["reasoning_tokens"] >= o["steps_scored"]
    assert resp.usage.completion_tokens == 24 and resp.choices[0].finish_reason == "length"


def test_request_stops_early(srv):
    resp = chat(srv, {"delta": 0.2, "policy": "stop"}, max_tokens=200)
    o = orca_of(resp)
    assert o["lambda"] == 0.5 and o["stopped_early"] is True and o["stop_step"] == 1
    assert o["last_score"] >= 0.5
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 50


def test_policy_answer_closes_reasoning_and_answers(srv):
    # The tiny tokenizer marks </think> as a special token: keep it in the text so that the
    # (text-based, non-streaming) reasoning parser can split reasoning from content.
    resp = srv.client().chat.completions.create(
        model=server_model(srv), messages=MSG, max_tokens=200, temperature=0,
        extra_body={"orca": {"delta": 0.2, "policy": "answer", "answer_budget": 6},
                    "skip_special_tokens": False})
    o = orca_of(resp)
    assert o["stopped_early"] is True and o["stop_step"] == 1 and o["stop_reason"] == "probe"
    assert o["forced_tokens"] > 0 and o["answer_budget"] == 6
    msg = resp.choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning")
    assert reasoning and "</think>" not in reasoning
    assert msg.content is not None and "</think>" not in msg.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens <= o["reasoning_tokens"] + o["forced_tokens"] + 6 + 1


def test_n_choices_each_get_their_result(srv):
    resp = srv.client().chat.completions.create(
        model=server_model(srv), messages=MSG, max_tokens=20, temperature=1.0, seed=3, n=3,
        extra_body={"orca": {"delta": 0.2, "policy": "shadow"}})
    o = orca_of(resp)
    assert [c["index"] for c in o["choices"]] == [0, 1, 2] and "steps_scored" not in o
    for c in o["choices"]:
        assert "error" not in c and c["stopped_early"] is False
        assert c["would_stop_step"] == (1 if c["steps_scored"] else None)


def test_streaming_with_reasoning_parser(srv):
    stream = srv.client().chat.completions.create(
        model=server_model(srv), messages=MSG, max_tokens=200, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"orca": {"delta": 0.2, "policy": "answer", "answer_budget": 6}})
    chunks = list(stream)
    with_orca = [c for c in chunks if "orca" in (c.model_extra or {})]
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0] in with_orca
    assert chunks[-1].usage is not None and chunks[-1] in with_orca
    assert len(with_orca) == 2  # the finish_reason chunk and the usage chunk, nothing else
    o = orca_of(finish[0])
    assert o == orca_of(chunks[-1]) and o["stopped_early"] is True
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning and content and "</think>" not in reasoning + content
    assert finish[0].choices[0].finish_reason == "stop"


def test_streaming_stop_policy_without_usage(srv):
    stream = srv.client().chat.completions.create(
        model=server_model(srv), messages=MSG, max_tokens=200, temperature=0, stream=True,
        extra_body={"orca": {"delta": 0.2, "policy": "stop"}})
    chunks = list(stream)
    assert "orca" in (chunks[-1].model_extra or {}) and chunks[-1].choices[0].finish_reason == "stop"
    assert orca_of(chunks[-1])["stop_step"] == 1


def test_completions_endpoint_and_vllm_xargs_spelling(srv):
    c = srv.client()
    resp = c.completions.create(model=server_model(srv), prompt="Try x = 3:", max_tokens=16,
                                temperature=0,
                                extra_body={"vllm_xargs": {"orca_delta": 0.2, "orca_policy": "shadow"}})
    o = orca_of(resp)
    assert o["policy"] == "shadow" and o["stopped_early"] is False and o["would_stop_step"] == 1
    assert resp.usage.completion_tokens == 16


def test_disabled_request_identical_to_plain_vllm(srv, servers):
    plain = servers["plain"].wait()
    try:
        for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "top_p": 0.9}):
            a = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
                "model": server_model(srv), "messages": MSG, "max_tokens": 40,
                "orca": {"enabled": False}, **kw}).json()
            b = httpx.post(plain.url + "/v1/chat/completions", timeout=120, json={
                "model": server_model(plain), "messages": MSG, "max_tokens": 40, **kw}).json()
            assert a.pop("orca") == {"enabled": False} and "orca" not in b
            assert json.dumps(a["choices"]) == json.dumps(b["choices"])
            assert a["usage"] == b["usage"]
    finally:
        plain.stop()  # free the cores for the rest of the module


def test_mixed_deltas_and_policies_concurrently(srv):
    combos = [({"delta": 0.2, "policy": "stop"}, True), ({"delta": 0.1, "policy": "answer"}, False),
              ({"delta": 0.2, "policy": "shadow"}, False), ({"delta": 0.05, "policy": "stop"}, False),
              ({"enabled": False}, None), ({"delta": 0.2, "policy": "answer"}, True)] * 2

    async def go():
        c = srv.aclient()
        return await asyncio.gather(*[c.chat.completions.create(
            model=server_model(srv), messages=MSG, max_tokens=30, temperature=0,
            extra_body={"orca": o}) for o, _ in combos])

    for (req, stops), resp in zip(combos, asyncio.run(go())):
        o = orca_of(resp)
        if stops is None:
            assert o == {"enabled": False}
            continue
        assert (o["delta"], o["policy"], o["stopped_early"]) == (req["delta"], req["policy"], stops)
        assert o["lambda"] == DELTAS[req["delta"]]
        if req["policy"] == "shadow":
            assert o["would_stop_step"] == 1 and o["stop_step"] is None
        if not stops:
            assert resp.usage.completion_tokens == 30


def _fingerprint(resp) -> tuple:
    o = dict(orca_of(resp))
    score = o.pop("last_score", None)
    return (json.dumps(o, sort_keys=True), None if score is None else round(score, 4),
            resp.choices[0].finish_reason, resp.usage.completion_tokens,
            resp.choices[0].message.content, (resp.choices[0].message.model_extra or {}).get("reasoning"))


def test_64_concurrent_requests_match_serial_runs(srv):
    """No state crosses between requests: each of 64 concurrent requests gets the same text and
    the same orca result as when it runs alone. Even requests are greedy; odd ones sample with
    their own seed (per-request generators: deterministic too), so trajectories differ."""
    settings = [{"delta": 0.1, "policy": "answer"}, {"delta": 0.2, "policy": "shadow"},
                {"delta": 0.2, "policy": "stop"}, {"delta": 0.05, "policy": "answer"},
                {"delta": 0.2, "policy": "answer", "answer_budget": 3}, {"enabled": False},
                {"delta": 0.05, "policy": "shadow"}]
    reqs = [dict(messages=[{"role": "user", "content": f"Problem {i}: find x with {i}*x = {i * 7}."}],
                 max_tokens=8 + (i * 5) % 23, extra_body={"orca": settings[i % len(settings)]},
                 **({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}))
            for i in range(64)]

    async def together():
        c = srv.aclient()
        return await asyncio.gather(*[c.chat.completions.create(model=server_model(srv), **r)
                                      for r in reqs])

    concurrent = asyncio.run(together())
    c = srv.client()
    for r, got in zip(reqs, concurrent):
        alone = c.chat.completions.create(model=server_model(srv), **r)
        assert _fingerprint(got) == _fingerprint(alone)
    assert len({got.id for got in concurrent}) == 64
    steps = {orca_of(g).get("steps_scored") for g in concurrent}
    assert len(steps) > 3  # the results really differ between requests


def test_aborted_stream_leaves_server_healthy(srv):
    def running() -> float:
        text = httpx.get(srv.url + "/metrics").text
        m = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+-]+)$", text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60, json={
            "model": server_model(srv), "messages": MSG, "max_tokens": 400, "stream": True,
            "temperature": 0, "orca": {"delta": 0.1, "policy": "answer"}}) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break  # closing the response mid-stream aborts the request
    deadline = time.time() + 30
    while running() > 0 and time.time() < deadline:
        time.sleep(0.5)
    assert running() == 0
    assert httpx.get(srv.url + "/health").status_code == 200
    o = orca_of(chat(srv, {"delta": 0.2, "policy": "stop"}, max_tokens=50))
    assert o["stopped_early"] is True and o["stop_step"] == 1


# -- errors, bundle endpoint, metrics -----------------------------------------------------------
@pytest.mark.parametrize("orca, param", [
    ({"delta": 0.2, "bogus": 1}, "orca.bogus"),
    ({"delta": "0.05"}, "orca.delta"),
    ({"policy": "sometimes"}, "orca.policy"),
    ({"answer_budget": -1}, "orca.answer_budget"),
    ({"enabled": "yes"}, "orca.enabled"),
])
def test_malformed_orca_is_400(srv, orca, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(srv, orca)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == param and err["code"] == 400 and err["type"] == "BadRequestError"


def test_delta_without_lambda_is_400_listing_deltas(srv):
    with pytest.raises(openai.BadRequestError) as e:
        chat(srv, {"delta": 0.07})
    assert "available deltas: 0.05, 0.1, 0.2" in e.value.body["message"]
    r = httpx.post(srv.url + "/v1/completions", json={
        "model": server_model(srv), "prompt": "x", "vllm_xargs": {"orca_delta": 0.3}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.orca_delta"


def test_bundle_endpoint(srv, env):
    r = httpx.get(srv.url + "/v1/orca/bundle")
    assert r.status_code == 200
    s = r.json()
    assert s["model"]["hidden_size"] == HIDDEN and s["default_delta"] == 0.2
    assert [row["delta"] for row in s["ltt"]["rows"]] == [0.05, 0.1, 0.2]
    assert s["probe"]["variant"] == "noqk" and "weights" not in s["probe"]
    assert "weights" not in json.dumps(s)
    # the bundle records a calibration in bfloat16 (conftest's tiny_server), COMMON serves float32
    assert re.search(r"^orca-serve: warning: the bundle was calibrated on \S+ hidden states "
                     r"computed in bfloat16, this server computes in float32: ",
                     srv.log.read_text(), re.MULTILINE)


def test_bundle_reload_route_is_off_without_the_admin_key_option(srv, env):
    r = httpx.post(srv.url + "/v1/orca/bundle", json={"path": str(env["bundle"])},
                   headers={"Authorization": "Bearer x"}, timeout=30)
    assert r.status_code == 404, r.text
    assert "--orca-admin-key-env" in r.json()["error"]["message"]
    assert httpx.get(srv.url + "/v1/orca/bundle", timeout=30).status_code == 200


def test_metrics_have_orca_counts(srv):
    chat(srv, {"delta": 0.2, "policy": "shadow"})
    chat(srv, {"enabled": False})
    time.sleep(0.5)
    text = httpx.get(srv.url + "/metrics").text
    name = re.escape(server_model(srv))
    orca_lines = [ln for ln in text.splitlines() if ln.startswith("orca_")]
    assert orca_lines and all(re.search(f'model_name="{name}"', ln) for ln in orca_lines)
    text = re.sub(rf'\{{model_name="{name}"\}}|,?model_name="{name}",?', "", text)
    text = text.replace("{,", "{").replace(",}", "}")

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
        assert m, f"{name} missing from /metrics"
        return float(m.group(1))

    for outcome in ("stopped_early", "finished", "shadow_would_stop", "disabled"):
        assert value(f'orca_requests_total{{outcome="{outcome}"}}') > 0
    assert value("orca_steps_scored_total") > 0
    assert value("orca_reasoning_tokens_total") > 0
    assert value('orca_stop_step_count{kind="stopped"}') > 0
    assert value('orca_stop_step_count{kind="shadow"}') > 0
    assert value("orca_last_score_count") > 0
    assert value("orca_probe_seconds_total") > 0 and value("orca_engine_steps_total") > 0
    # every result was fetched (the aborted stream's too): nothing left behind in the engine
    assert value("orca_engine_tracked_requests") == 0
    assert value("orca_engine_stored_results") == 0
    assert "orca_tokens_saved_total" in text
