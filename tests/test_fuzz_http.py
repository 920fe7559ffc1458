"""What `orca-serve --demo` serves, under hostile and unusual HTTP input: conftest's `toy_server`
(the embedded toy reasoner with its shipped bundle under the bundle's name, plus a consensus block
that only `orca.samples` requests use), shared with test_server_samples and test_server_gate_alarm
and run before them (a server start is two processes importing vLLM, ~20 s of a core).

- vLLM 0.32's CPU build crashed the engine on seeded requests whose prompt prefill got chunked
  (12 concurrent ~680-token prompts did it with the demo's defaults); the server keeps prefills
  whole on CPU (`orca_serve.startup.vllm_setup.keep_prefills_whole`).
- The Responses and Messages APIs run orca like chat (the server's defaults) and report it; routes
  that cannot report what orca did (the batch route, ...) run without orca and refuse orca
  settings with a 400, instead of cutting requests short silently.
- JSON nested too deeply is a 400; /openapi.json works and documents the `orca` field.
- A bounded schemathesis run over the server's own OpenAPI description: no 5xx, no hang, no crash
  (`tests/http_fuzz.py`; the long run is `scripts/fuzz_http.py`).
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

pytestmark = pytest.mark.vllm

from tests.serving import Server

QUESTION = "Find the integer x with 7*x + 3 = 52."


@pytest.fixture(scope="module")
def demo(toy_server) -> Server:
    return toy_server.wait()


def model(server: Server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]


def chat(server: Server, **body) -> httpx.Response:
    body = {"model": model(server), "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 8, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)


def long_prompt(i: int) -> str:
    """~680 tokens of the demo tokenizer, different for every i."""
    return f"Problem {i}: " + " ".join(f"find x with {i}*x + {j} = {i * j + 3}." for j in range(36))


def test_concurrent_seeded_long_prompts_do_not_crash_the_engine(demo):
    """12 concurrent seeded requests whose prompts do not all fit one step's token budget: on
    vLLM's CPU build with chunked prefill this killed the engine (every request 500, /health
    503, all processes gone)."""
    async def go():
        c = demo.aclient()
        name = model(demo)
        return await asyncio.gather(*[c.chat.completions.create(
            model=name, messages=[{"role": "user", "content": long_prompt(i)}], max_tokens=16,
            temperature=1.0, seed=i, extra_body={"orca": {"enabled": False}})
            for i in range(12)], return_exceptions=True)

    results = asyncio.run(go())
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors[0]
    prompt_tokens = sorted(r.usage.prompt_tokens for r in results)
    assert 600 <= prompt_tokens[0] and prompt_tokens[-1] <= 900, prompt_tokens
    assert sum(prompt_tokens) > 2 * 2048  # several steps' worth of prefill (the CPU budget)
    assert httpx.get(demo.url + "/health", timeout=30).status_code == 200
    r = chat(demo, orca={"policy": "shadow"})
    assert r.status_code == 200 and r.json()["orca"]["enabled"] is True


def test_every_route_either_reports_orca_or_runs_without_it(demo):
    name = model(demo)
    full = chat(demo, max_tokens=512, temperature=0, orca={"enabled": False}).json()
    tokens = full["usage"]["completion_tokens"]
    early = chat(demo, max_tokens=512, temperature=0).json()  # the server's default: answer
    assert early["orca"]["stopped_early"] and early["usage"]["completion_tokens"] < tokens

    # the Responses and Messages APIs run the same request as chat (the same chat template):
    # stopped by the server's default like chat, reported, and the full text with orca off
    responses = {"model": name, "input": QUESTION, "max_output_tokens": 512, "temperature": 0}
    messages = {"model": name, "max_tokens": 512, "temperature": 0,
                "messages": [{"role": "user", "content": QUESTION}]}
    for path, body in (("/v1/responses", responses), ("/v1/messages", messages)):
        r = httpx.post(demo.url + path, timeout=300, json=body).json()
        assert r["usage"]["output_tokens"] == early["usage"]["completion_tokens"]
        assert r["orca"]["stopped_early"] == early["orca"]["stopped_early"]
        r = httpx.post(demo.url + path, timeout=300, json={**body, "orca": {"enabled": False}})
        assert r.json()["usage"]["output_tokens"] == tokens

    for path, body in [
        ("/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": "x"}]],
                                        "orca": "garbage"}),
        ("/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": "x"}]],
                                        "vllm_xargs": {"orca_policy": "shadow"}}),
    ]:
        r = httpx.post(demo.url + path, json={"model": name, **body}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and path in err["message"]


def test_deep_json_is_400_and_openapi_documents_orca(demo):
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    for path in ("/v1/chat/completions", "/v1/responses"):
        r = httpx.post(demo.url + path, content=deep, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text[:300]
    r = httpx.get(demo.url + "/openapi.json", timeout=60)
    assert r.status_code == 200, r.text[:300]
    schemas = r.json()["components"]["schemas"]
    for req in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest",
                "AnthropicMessagesRequest"):
        assert "OrcaFields" in str(schemas[req]["properties"]["orca"])
    assert set(schemas["OrcaFields"]["properties"]) == {"enabled", "delta", "policy",
                                                        "answer_budget", "give_up",
                                                        "shift_alpha", "shift_give_up_alpha",
                                                        "group", "samples"}
    assert set(schemas["GiveUpFields"]["properties"]) == {"enabled", "delta"}


def test_orca_metrics_carry_vllms_model_name(demo):
    assert chat(demo).status_code == 200
    text = httpx.get(demo.url + "/metrics", timeout=60).text
    name = model(demo)  # once: a request each
    names = set(re.findall(r'^vllm:[a-z_]+\{[^}]*model_name="([^"]*)"', text, re.MULTILINE))
    assert names == {name}
    orca = [ln for ln in text.splitlines() if ln.startswith("orca_")]
    assert orca and all(f'model_name="{name}"' in ln for ln in orca)
    assert "/" not in name  # the bundle's portable name, not the model's install path


def test_fuzz_http_surface(demo):
    """schemathesis over every client route of /openapi.json (orca field included), positive and
    negative inputs: no 5xx, no request past its timeout, the server alive afterwards."""
    from tests.http_fuzz import fuzz, healthy

    report = fuzz(demo.url, examples=10, timeout=60, deadline_s=240)
    print(f"fuzz: {report.operations} operations, {report.cases} cases in "
          f"{report.seconds:.0f} s, statuses {dict(sorted(report.by_status.items()))}, "
          f"unusable operations {report.unusable}, known vLLM issues {dict(report.known)}")
    assert report.cases >= 200
    assert not report.findings, "\n".join(f"{f.key}\n  {f.example}"
                                          for f in report.findings.values())
    assert healthy(demo.url)
    assert chat(demo).status_code == 200
