"""Giving up in the engine-step core (orca_serve.core), driven by the simulated engine of
tests/core_sim.py: a two-sided bundle whose give-up score is known (a constant probe), so which
requests give up, where, and with which forced tokens is known."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orca_serve.settings.contract import XARG_GIVE_UP_MU, XARG_LAM, OrcaResult
from tests.bundles import tiny_bundle, with_give_up, write_bundle
from tests.core_sim import (
    DIM,
    EOS,
    FORCE,
    ID,
    WINDOW,
    make_core,
    run_requests,
    sim_probe,
)


@pytest.fixture(scope="module")
def two_sided_path(tmp_path_factory):
    # give-up score sigmoid(-2) = 0.12 at every step: mu 0.2 gives up, mu 0.1 does not
    b = with_give_up(tiny_bundle(sim_probe(), [(0.05, None), (0.1, 0.75)], vocab=ID,
                                 window=WINDOW, default_delta=0.1, name="fake", hidden_size=DIM),
                     [(0.05, 0.1), (0.1, 0.2)], bias=-2.0)
    return write_bundle(b, tmp_path_factory.mktemp("two") / "bundle.json")


def test_a_request_gives_up_at_its_first_step_below_mu_and_answers_its_best_guess(two_sided_path):
    never = {XARG_LAM: "inf"}  # the upper threshold never fires: only the give-up can end it
    sims, res = run_requests(two_sided_path, {
        "gives-up": {**never, XARG_GIVE_UP_MU: 0.2, "orca_answer_budget": 4},
        "above-mu": {**never, XARG_GIVE_UP_MU: 0.1},
        "off": dict(never),
        "audited": {**never, XARG_GIVE_UP_MU: 0.2, "orca_policy": "shadow"},
        "tie": {XARG_LAM: 0.0, XARG_GIVE_UP_MU: 0.2},  # both fire at step 1: the stop wins
    })
    r = res["gives-up"]
    assert r["stop_reason"] == "give_up" and r["give_up_step"] == 1 == r["steps_scored"]
    assert not r["stopped_early"] and OrcaResult.from_wire(r).ended == "gave_up"
    assert r["give_up_mu"] == 0.2 and r["last_give_up_score"] == pytest.approx(0.1192, abs=1e-4)
    # the best guess: the stop's forced text, 4 answer tokens, EOS
    assert r["forced_tokens"] == FORCE + [EOS]
    out = sims["gives-up"].out
    assert out[-1] == EOS and out[-5 - len(FORCE):-5] == FORCE
    for name in ("above-mu", "off", "audited"):  # never give up; the audited one runs to the end
        r = res[name]
        assert r["stop_reason"] != "give_up" and r.get("give_up_step") is None, name
        assert OrcaResult.from_wire(r).ended == "full", name
        assert r["steps_scored"] > 1, name
        assert len(sims[name].out) > len(sims["gives-up"].out), name
    r = res["tie"]
    assert r["stopped_early"] and r["stop_reason"] == "probe" and r["give_up_step"] is None


def test_a_mu_just_below_the_float32_score_does_not_give_up(two_sided_path):
    """The give-up score is float32 and the calibration compares it with mu* in float64
    (`orca_method.give_up`); the engine too: a mu* whose nearest float32 is the score, but which
    lies below it, does not give up."""
    g = float(torch.sigmoid(torch.tensor(-2.0)))  # the constant give-up score, float32
    below = g - float(np.spacing(np.float32(g))) / 4  # rounds to `g` in float32
    assert np.float32(below) == g and below < g
    _, res = run_requests(two_sided_path, {"at": {XARG_LAM: "inf", XARG_GIVE_UP_MU: g}})
    assert res["at"]["stop_reason"] == "give_up" and res["at"]["last_give_up_score"] == g
    _, res = run_requests(two_sided_path, {"below": {XARG_LAM: "inf", XARG_GIVE_UP_MU: below}})
    assert res["below"]["stop_reason"] != "give_up" and res["below"]["give_up_step"] is None


def test_the_message_policy_forces_the_end_of_thinking_text_the_message_and_eos(two_sided_path):
    sims, res = run_requests(two_sided_path, {"m": {XARG_LAM: "inf", XARG_GIVE_UP_MU: 0.2}},
                     defaults={"give_up_policy": "message", "give_up_message": "abc"})
    r = res["m"]
    want = FORCE + [ID["a"], ID["b"], ID["c"], EOS]
    assert r["stop_reason"] == "give_up" and r["forced_tokens"] == want
    out = sims["m"].out
    assert out[-len(want):] == want


def test_a_one_sided_bundle_is_refused_by_a_reload_under_a_give_up_default(
        two_sided_path, bundle_path, other_bundle_path):
    """--orca-give-up-delta: every request gives up with that delta, so a hot reload to a bundle
    without its mu* (here a one-sided one) is refused before any engine is asked; the
    two-sided one reloads and its deployment's bank carries the give-up probe."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from orca_method.bundle import load_bundle
    from orca_serve.metrics.prometheus import OrcaMetrics
    from orca_serve.api_server.reload import ReloadRefused
    from orca_serve.settings.resolve import OrcaDefaults
    from tests.servers import orca_server

    core = make_core(bundle_path)
    # the engine side of the reload RPCs, on a real core (the worker extension's answers)
    engine = {"orca_load_bundle": lambda p: {"checksum": core.load_bundle(p).checksum},
              "orca_use_bundle": lambda c: {"checksum": core.use_bundle(c).checksum},
              "orca_retire_bundles": lambda k: {"live": core.retire_bundles(k)}}
    calls = []

    async def rpc(method, args=()):
        calls.append(method)
        return [engine[method](*args)]

    state = orca_server(load_bundle(bundle_path), OrcaDefaults(delta=0.1, give_up_delta=0.1),
                        rpc=rpc, metrics=OrcaMetrics(CollectorRegistry(), model_name="m"),
                        reloader={"calib_path": str(bundle_path)})
    with pytest.raises(ReloadRefused, match="--orca-give-up-delta 0.1: this bundle has no "
                                            "give-up threshold"):
        asyncio.run(state.reloader.reload(str(other_bundle_path), source="test"))
    assert calls == []
    assert asyncio.run(state.reloader.reload(str(two_sided_path), source="test"))["changed"]
    assert core.dep.bank.give_up is not None
