"""Early stopping on vLLM's own OpenAI server, without orca-serve (docs/PLUGIN.md, "Stock vLLM").

Starts `python -m vllm.entrypoints.openai.api_server` with the demo model, the plugin's logits
processor and the demo bundle in `--additional-config`, and asks through the OpenAI client with
per-request `vllm_xargs` and no `orca_key`: the processor resolves lambda* from the bundle by
itself and stops the reasoning. Evidence of the stop (there is no `orca` object on this path):
the same greedy request with `orca_enabled: 0` reasons longer; the stopped one is the unforced
output up to the stop, then the forced end-of-thinking text.

Orca metrics on that server come from the plugin's entry points (orca_serve/metrics/stock.py),
which exist only when this checkout is installed (`pip install -e .`): that test is skipped,
saying so, where they are not registered.
"""

from __future__ import annotations

import json
import re
import sys
import time
from importlib.metadata import entry_points

import httpx
import openai
import pytest

from orca_method.bundle import load_bundle
from orca_serve.startup.demo import QUESTION
from orca_serve.startup.preflight import demo_paths
from orca_serve.vllm_plugin.config import PROCESSOR_FQCN
from tests.serving import Server

pytestmark = pytest.mark.vllm

MAX_TOKENS = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, bundle = demo_paths()
    log = tmp_path_factory.mktemp("stock") / "server.log"
    srv = Server([sys.executable, "-m", "vllm.entrypoints.openai.api_server"], log, [
        "--model", str(model), "--host", "127.0.0.1", "--enforce-eager",
        "--logits-processors", PROCESSOR_FQCN,
        "--additional-config", json.dumps({"orca": {"bundle": str(bundle.absolute())}})])
    try:
        yield srv.wait()
    finally:
        srv.stop()


def _ask(srv: Server, **xargs):
    client = srv.client()
    return client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"vllm_xargs": xargs} if xargs else None)


def test_reasoning_stops_early_without_orca_serve(server):
    force = load_bundle(demo_paths()[1]).think.force_text  # "\n</think>\n\n"
    full = _ask(server, orca_enabled=0)
    early = _ask(server)  # bundle defaults: enabled, default delta, policy answer
    full_text, early_text = full.choices[0].message.content, early.choices[0].message.content
    assert "orca" not in (early.model_extra or {})  # vLLM's own response, nothing added
    assert early.usage.completion_tokens < full.usage.completion_tokens
    # greedy: identical up to the stop, then the forced end of thinking, then an answer
    cut = early_text.index(force)
    assert full_text.startswith(early_text[:cut])
    assert full_text[cut:].split("</think>")[0].strip(), "the full run reasons on past the stop"
    assert early.choices[0].finish_reason == "stop"


def test_per_request_xargs_policy_and_delta(server):
    full = _ask(server, orca_enabled=0)
    stop = _ask(server, orca_policy="stop")  # EOS at the stop step: no end-of-thinking text
    text = stop.choices[0].message.content
    assert stop.choices[0].finish_reason == "stop" and "</think>" not in text
    assert full.choices[0].message.content.startswith(text)
    assert stop.usage.completion_tokens < full.usage.completion_tokens
    shadow = _ask(server, orca_policy="shadow")  # scores, never forces: the unforced output
    assert shadow.choices[0].message.content == full.choices[0].message.content
    # a larger delta has a lower (or equal) lambda*: it stops no later
    bundle = load_bundle(demo_paths()[1])
    deltas = sorted(r.delta for r in bundle.ltt.rows if r.lam is not None)
    lo, hi = (_ask(server, orca_policy="stop", orca_delta=d) for d in (deltas[0], deltas[-1]))
    assert hi.usage.completion_tokens <= lo.usage.completion_tokens


def test_bad_xargs_are_a_400_from_vllm(server):
    with pytest.raises(openai.BadRequestError, match="orca_policy"):
        _ask(server, orca_policy="later")


def _orca_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^(orca_\w+)\{model_name="[^"]+"\} (\S+)$', text, re.MULTILINE)}


def test_orca_metrics_on_the_stock_server(server):
    names = {e.value for e in entry_points(group="vllm.stat_logger_plugins")}
    if "orca_serve.metrics.stock:OrcaStatLogger" not in names:
        pytest.skip("orca-serve's vLLM entry points are not registered: pip install -e .")
    _ask(server)  # scored steps, whatever ran before
    deadline, got = time.time() + 60, {}
    while time.time() < deadline:  # the workers publish every PUBLISH_S seconds
        got = _orca_metrics(server.url)
        if got.get("orca_steps_scored_total", 0) > 0 and \
                got.get("orca_engine_tracked_requests") == 0:  # a snapshot after the request
            break
        time.sleep(1)
    assert got.get("orca_steps_scored_total", 0) > 0, got
    assert got["orca_engine_tracked_requests"] == 0, got  # nothing running any more
    assert got["orca_engine_steps_total"] > 0 and got["orca_probe_seconds_total"] > 0
    assert got["orca_engine_bundles_loaded"] == 1
