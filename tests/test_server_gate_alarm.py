"""The gate alarm on a real orca-serve: the embedded toy reasoner with its shipped bundle (what
`orca-serve --demo` serves; conftest's `toy_server`, shared with test_server_samples, whose
bundle adds a consensus block), real vLLM, real HTTP. The bundle's gate flags about all of the
toy's shifted prompts and about alpha of its in-distribution ones, so a run of shifted requests
raises the alarm within a handful, and then an in-distribution request the gate alone passes is
served as a flagged one (full reasoning: this server runs `--orca-shift-action full`, so that a
request served safely shows as one that never stopped; the default, `strict`, serves the
bundle's largest lambda*) and says so."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from orca_demo.toy import tasks as toy_tasks
from orca_demo.toy.demo_bundle import demo_folder
from orca_method.bundle import load_bundle
from tests.serving import Server, orca_of

pytestmark = pytest.mark.vllm

TOY = demo_folder("toy")
MAX_TOKENS = 400  # the toy's traces end well within it (bench_frontier's)


@pytest.fixture(scope="module")
def toy(toy_server) -> Server:
    return toy_server.wait()


def _prompts(tmp: Path, family: str, n: int) -> list[dict]:
    path = tmp / f"{family}.jsonl"
    toy_tasks.write_prompts(path, family, n, seed=7)
    return [json.loads(x) for x in path.read_text().splitlines()]


def _ask(server: Server, prompt: dict) -> dict:
    """One greedy request at delta 0.2 (the toy bundle's lambda* there stops most in-distribution
    traces early: a request that reasons in full was served the safe way)."""
    r = server.client(timeout=300).chat.completions.create(
        model=load_bundle(TOY / "bundle.json").model.name, messages=prompt["messages"],
        temperature=0, max_tokens=MAX_TOKENS, extra_body={"orca": {"delta": 0.2}})
    return orca_of(r)


def _metric(server: Server, prefix: str) -> float:
    """The value of the first sample whose line starts with `prefix` (name and labels)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return float(next(ln for ln in text.splitlines() if ln.startswith(prefix))
                 .rsplit(" ", 1)[1])


def test_after_the_alarm_an_unflagged_request_is_served_the_safe_way(toy, tmp_path) -> None:
    # shifted traffic, one request at a time: the gate flags them, the alarm is raised
    sent = flagged = 0
    for p in _prompts(tmp_path, "shifted", 12):
        o = _ask(toy, p)
        sent += 1
        if o.get("shift_alarm"):
            break
        flagged += o["shift"]["flagged"]
    assert o.get("shift_alarm") is True, f"no alarm after {sent} shifted requests ({flagged} " \
                                          "flagged)"
    # 3 flags in a row raise it at the toy's n and alpha; the request that raised it had decided
    # already (the engine core hears each gate at its gate step), so the next one is served
    assert sent <= 8
    assert _metric(toy, "orca_shift_alarm{") == 1.0
    assert _metric(toy, 'orca_shift_alarm_changes_total{change="raised"') == 1.0
    # in-distribution traffic: the first request the gate alone passes is served as a flagged
    # one, says so, and reasons in full
    for p in _prompts(tmp_path, "in-dist", 10):
        o = _ask(toy, p)
        assert o["shift_alarm"] is True, o  # it takes ~90 such requests to clear
        if not o["shift"]["flagged"]:
            break
    assert o["shift"]["flagged"] is False and o["shift"]["pvalue"] > o["shift"]["alpha"]
    assert o["shift"]["alarm"] is True  # the engine core's alarm served it, not its lambda*
    assert not o["stopped_early"] and o["ended"] == "full"
    assert _metric(toy, "orca_shift_alarm_served_total{") >= 2
