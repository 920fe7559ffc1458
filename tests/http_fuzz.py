"""Fuzzing a running server's HTTP surface with schemathesis, from its own /openapi.json.

Shared by `tests/test_fuzz_http.py` (a bounded run) and `scripts/fuzz_http.py` (a long one).
Every operation a client can call is fuzzed with schema-valid (positive) and schema-violating
(negative) inputs; a finding is a 5xx, a request that outlives its timeout, or the server going
away (501, vLLM's "this model does not serve that route", is counted but is not a finding).
State-changing admin routes are left out (fuzzing them tests nothing but what they are for).

Generated bodies are made cheap to serve: token limits and `n` are clamped, so a valid request
costs the tiny model a fraction of a second; what is under test is input handling, not the
engine's speed.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.result import Err

# Admin and lifecycle routes: not a client's surface, and fuzzing them would pause, scale or
# sleep the engine on purpose.
EXCLUDE = (r"^/(pause|resume|sleep|wake_up|scale_elastic_ep|is_scaling_elastic_ep|"
           r"start_profile|stop_profile|collective_rpc|reset_.*|release_kv_cache_memory|"
           r"v1/(load|unload)_lora_adapter|init_weight_transfer_engine|.*weight.*|"
           r"(inference/v1/)?abort_requests|fault_tolerance/.*)$")
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")
# vLLM's deliberate answer on a route the model does not serve (e.g. structured decisions on
# a model without them): counted, not a finding.
NOT_IMPLEMENTED = 501
MAX_TOKENS = 8
MAX_N = 2
INT64 = (-2**63, 2**64 - 1)  # the integers vLLM's structured outputs take (docs/KNOWN-ISSUES.md)


def _huge_int(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return not INT64[0] <= x <= INT64[1]
    if isinstance(x, dict):
        return any(_huge_int(v) for v in x.values())
    if isinstance(x, list):
        return any(_huge_int(v) for v in x)
    return False


def known_vllm_issue(body: Any, status: int, message: str) -> str | None:
    """A 5xx that plain vLLM 0.32 gives as well (docs/KNOWN-ISSUES.md), named; None otherwise."""
    if status == 500 and not message.strip() and _huge_int(body):
        return "vLLM 0.32: an integer beyond 64 bits in a JSON schema is a 500"
    so = body.get("structured_outputs") if isinstance(body, dict) else None
    if (status == 500 and so is not None and not isinstance(so, dict)
            and "has no attribute" in message):
        return "vLLM 0.32: a structured_outputs that is not an object is a 500"
    return None


@dataclass
class Finding:
    key: str  # what makes two findings the same: operation, kind, first line of the message
    example: str  # a curl command that reproduces it


@dataclass
class Report:
    cases: int = 0
    by_status: Counter = field(default_factory=Counter)
    findings: dict[str, Finding] = field(default_factory=dict)
    crashed: bool = False
    seconds: float = 0.0
    operations: int = 0
    unusable: list[str] = field(default_factory=list)  # operations whose schema cannot be fuzzed
    known: Counter = field(default_factory=Counter)  # 5xx answers of known vLLM issues

    def add(self, key: str, example: str) -> None:
        self.findings.setdefault(key, Finding(key, example))


def serviceable(body: Any, model: str) -> Any:
    """A schema-valid body made to reach the engine cheaply: the served model's name (a random
    one only tests vLLM's 404), token limits and `n` clamped; the rest as generated."""
    if isinstance(body, dict) and "model" in body:
        body["model"] = model
    return cheap(body)


def cheap(body: Any) -> Any:
    """Clamp what makes a valid request expensive (token limits, n); leave the rest as generated."""
    if isinstance(body, dict):
        for k in TOKEN_LIMITS:
            if isinstance(body.get(k), int) and not isinstance(body.get(k), bool):
                body[k] = max(0, min(body[k], MAX_TOKENS)) if body[k] >= 0 else body[k]
        if "max_tokens" not in body and ("messages" in body or "prompt" in body):
            body["max_tokens"] = MAX_TOKENS
        if isinstance(body.get("n"), int) and body["n"] > MAX_N:
            body["n"] = MAX_N
        sp = body.get("sampling_params")
        if isinstance(sp, dict):
            cheap(sp)
    return body


def _first_line(text: str) -> str:
    try:
        msg = httpx.Response(200, content=text).json()
        if isinstance(msg, dict):
            err = msg.get("error", msg)
            text = str(err.get("message", err) if isinstance(err, dict) else err)
    except ValueError:
        pass
    line = (text.strip().splitlines() or [""])[0]
    return re.sub(r"\d+", "N", line)[:160]  # numbers differ between instances of one bug


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def fuzz(url: str, *, examples: int, timeout: float = 60.0, seed_value: int = 0,
         deadline_s: float | None = None) -> Report:
    """Fuzz every operation of `url`'s OpenAPI description, `examples` cases per operation and
    generation mode. Stops early if the server dies or `deadline_s` passes."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json", timeout=timeout).exclude(
        path_regex=EXCLUDE)
    model = httpx.get(url + "/v1/models", timeout=timeout).json()["data"][0]["id"]
    report = Report()
    start = time.monotonic()
    session = requests.Session()
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            report.unusable.append(str(result.err()).splitlines()[0][:200])
            continue
        op = result.ok()
        report.operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if report.crashed or (deadline_s and time.monotonic() - start > deadline_s):
                break
            _fuzz_operation(op, mode, url, model, session, report, examples, timeout,
                            seed_value)
    report.seconds = time.monotonic() - start
    return report


def _fuzz_operation(op: Any, mode: GenerationMode, url: str, model: str,
                    session: requests.Session, report: Report, examples: int, timeout: float,
                    seed_value: int) -> None:
    name = f"{op.method.upper()} {op.path}"

    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if report.crashed:
            return
        if mode == GenerationMode.POSITIVE:
            case.body = serviceable(case.body, model)
        report.cases += 1
        try:
            resp = case.call(base_url=url, session=session, timeout=timeout)
        except requests.Timeout:
            report.add(f"{name}: no answer within {timeout:.0f} s", case.as_curl_command())
            return
        except requests.ConnectionError:
            report.crashed = not healthy(url)
            report.add(f"{name}: connection failed" + (" (server down)" if report.crashed
                                                       else ""), case.as_curl_command())
            return
        report.by_status[resp.status_code] += 1
        if resp.status_code >= 500 and resp.status_code != NOT_IMPLEMENTED:
            known = known_vllm_issue(case.body, resp.status_code, _first_line(resp.text))
            if known is not None:
                report.known[known] += 1
                return
            report.add(f"{name}: {resp.status_code} {_first_line(resp.text)}",
                       case.as_curl_command())

    try:
        run()
    except Unsatisfiable:
        pass  # no input of this mode exists (e.g. a negative case for a route without inputs)
