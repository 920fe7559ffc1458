"""`orca.give_up` on a real orca-serve (conftest's shared `tiny_server`, real OpenAI client).

The shared server's bundle is two-sided (tests/bundles.py, `make_bundle`): its give-up probe
scores 0.5 at every step, so give-up delta 0.05 (mu* 0.6) gives up at the first scored step and
0.02 (mu* never) does not; stop delta 0.1 (lambda* 0.99) never stops early, so only a give-up
can end the reasoning before max_tokens.
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.vllm

from tests.serving import MSG, chat, orca_of, server_model


@pytest.fixture(scope="module")
def srv(tiny_server):
    return tiny_server["server"].wait()


def test_a_request_gives_up_and_says_so(srv):
    full = chat(srv, {"delta": 0.1})
    gave = chat(srv, {"delta": 0.1, "give_up": {"delta": 0.05}})
    o, f = orca_of(gave), orca_of(full)
    assert f["ended"] == "full" and "give_up" not in f
    # the engine scores the give-up probe for every request; one that did not ask hears nothing
    assert "give_up_step" not in f and "last_give_up_score" not in f
    assert o["ended"] == "gave_up" and o["stop_reason"] == "give_up" and o["give_up_step"] == 1
    assert o["thinking_ended_by"] == "orca_give_up" and f["thinking_ended_by"] != "orca_give_up"
    assert o["give_up"] == {"delta": 0.05, "mu": 0.6, "policy": "guess", "source": "bundle",
                            "active": True}
    assert o["last_give_up_score"] == pytest.approx(0.5, abs=1e-6)
    assert not o["stopped_early"] and o["forced_tokens"] > 0  # the best guess's forced text
    assert gave.usage.completion_tokens < full.usage.completion_tokens


def test_a_risk_with_no_certified_give_up_and_shadow_requests_run_on(srv):
    o = orca_of(chat(srv, {"delta": 0.1, "give_up": {"delta": 0.02}}))
    assert o["ended"] == "full" and o["give_up"]["mu"] is None and o["give_up_step"] is None
    # shadow (what an audited request runs as) never gives up: it runs to its end, and says so
    o = orca_of(chat(srv, {"delta": 0.1, "policy": "shadow", "give_up": {"delta": 0.05}}))
    assert o["ended"] == "full" and o["give_up_step"] is None and o["forced_tokens"] == 0
    assert o["give_up"]["active"] is False and o["thinking_ended_by"] != "orca_give_up"


GAVE_UP = {"delta": 0.1, "give_up": {"delta": 0.05}}


def test_every_api_says_orca_ended_a_give_up(srv):
    """Completions, Responses and Messages report a give-up as chat does: orca ended the
    thinking (not the model), `ended: gave_up`."""
    c, model = srv.client(), str(server_model(srv))
    done = c.completions.create(model=model, prompt="Try x = 3:", max_tokens=48, temperature=0,
                                extra_body={"orca": GAVE_UP})
    resp = c.responses.create(model=model, input=MSG[0]["content"], max_output_tokens=48,
                              temperature=0, extra_body={"orca": GAVE_UP})
    msg = httpx.post(srv.url + "/v1/messages", timeout=120, json={
        "model": model, "max_tokens": 48, "messages": MSG, "temperature": 0, "orca": GAVE_UP})
    assert msg.status_code == 200, msg.text
    for api, o in (("completions", orca_of(done)), ("responses", orca_of(resp)),
                   ("messages", msg.json()["orca"])):
        assert (o["stop_reason"], o["ended"], o["thinking_ended_by"], o["give_up"]["active"]) \
            == ("give_up", "gave_up", "orca_give_up", True), (api, o)


def test_a_give_up_delta_without_mu_is_a_400(srv):
    with pytest.raises(openai.BadRequestError) as e:
        chat(srv, {"give_up": {"delta": 0.07}})
    assert e.value.body["param"] == "orca.give_up.delta"
    assert "available: 0.02, 0.05" in e.value.body["message"]


def test_give_ups_are_counted_per_outcome(srv):
    chat(srv, {"delta": 0.1, "give_up": {"delta": 0.05}})
    time.sleep(0.5)
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    gave = re.search(r'orca_requests_total\{[^}]*outcome="gave_up"[^}]*\} (\S+)', text)
    assert gave and float(gave.group(1)) >= 1
    tokens = re.search(r'orca_ended_reasoning_tokens_total\{[^}]*ended="gave_up"[^}]*\} (\S+)',
                       text)
    assert tokens and float(tokens.group(1)) > 0
