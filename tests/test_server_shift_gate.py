"""The shift gate on a real orca-serve (conftest's shared `tiny_server`, real OpenAI client).

The shared server's bundle carries `tests.bundles.far_gate` (fitted far from the tiny model's
step embeddings: it flags every request it runs for) and runs with `--orca-shift-alpha 0`, so a
request is gated only when it asks (`orca.shift_alpha`). Delta 0.2 (lambda* 0.5) stops every
ungated request at its first step. The bundle also has one group, CAUTIOUS, whose table never
stops (`orca.group`, docs/SERVER.md "Groups").
"""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.vllm

from tests.bundles import CAUTIOUS
from tests.serving import chat, orca_of


@pytest.fixture(scope="module")
def srv(tiny_server):
    return tiny_server["server"].wait()


def _flagged_count(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines()
                if ln.startswith("orca_shift_gated_total") and 'flagged="true"' in ln)
    return float(line.rsplit(" ", 1)[1])


def test_a_flagged_request_reasons_in_full_and_says_so(srv):
    before = _flagged_count(srv)
    ungated = orca_of(chat(srv, {"delta": 0.2}))
    assert ungated["stopped_early"] and ungated["stop_step"] == 1 and "shift" not in ungated
    o = orca_of(chat(srv, {"delta": 0.2, "shift_alpha": 0.05, "give_up": {"delta": 0.05}}))
    assert o["shift"] == {"alpha": 0.05, "give_up_alpha": 0.05, "pvalue": pytest.approx(1 / 40),
                          "flagged": True, "give_up_barred": True, "alarm": False}
    # no stop at step 1, no give-up (mu* 0.6 would give up at step 1 too): full reasoning
    assert not o["stopped_early"] and o["give_up_step"] is None and o["ended"] == "full"
    assert o["steps_scored"] > 1
    assert _flagged_count(srv) == before + 1


def test_a_request_barred_at_the_give_up_level_only_stops_but_never_gives_up(srv):
    """Two levels: p = 1/40 is above 0.02 (no stop-side flag: lambda* stops it at step 1 as
    usual) and at most 0.05 (its give-up is barred: mu* 0.6 would give up at step 1)."""
    levels = {"shift_alpha": 0.02, "shift_give_up_alpha": 0.05}
    o = orca_of(chat(srv, {"delta": 0.2, **levels}))
    assert o["shift"] == {"alpha": 0.02, "give_up_alpha": 0.05, "pvalue": pytest.approx(1 / 40),
                          "flagged": False, "give_up_barred": True, "alarm": False}
    assert o["stopped_early"] and o["stop_step"] == 1
    o = orca_of(chat(srv, {"delta": 0.05, **levels, "give_up": {"delta": 0.05}}))
    assert o["shift"]["give_up_barred"] and o["give_up_step"] is None and o["ended"] != "gave_up"
    with pytest.raises(openai.BadRequestError) as e:
        chat(srv, {"shift_alpha": 0.05, "shift_give_up_alpha": 0.02})
    assert e.value.body["param"] == "orca.shift_give_up_alpha"
    assert "at least the stop side's" in e.value.body["message"]


def test_a_bad_shift_alpha_is_a_400(srv):
    with pytest.raises(openai.BadRequestError) as e:
        chat(srv, {"shift_alpha": 1.5})
    assert e.value.body["param"] == "orca.shift_alpha"
    assert "[0, 1)" in e.value.body["message"]


def test_a_known_group_takes_its_table_ungated_and_an_unknown_one_the_mixtures(srv):
    """The request asks for the gate, which flags every request it runs for: the known group is
    not gated (its table certifies it) and never stops; an unknown group is served as a request
    without a group (delta 0.2's lambda* 0.5, gated, flagged) and says so."""
    o = orca_of(chat(srv, {"delta": 0.2, "shift_alpha": 0.05, "group": CAUTIOUS,
                           "give_up": {"delta": 0.05}}))
    assert o["group"] == CAUTIOUS and o["group_known"] is True
    assert o["lambda_source"] == "group" and o["lambda"] is None and "shift" not in o
    assert not o["stopped_early"] and o["give_up"]["mu"] is None  # no mu* of its own
    o = orca_of(chat(srv, {"delta": 0.2, "shift_alpha": 0.05, "group": "other"}))
    assert o["group"] == "other" and o["group_known"] is False
    assert o["lambda_source"] == "bundle" and o["lambda"] == 0.5 and o["shift"]["flagged"]
