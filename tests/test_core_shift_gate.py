"""The shift gate in the engine-step core (orca_serve.core), driven by the simulated engine of
tests/core_sim.py: a bundle whose gate was fitted on features far from the simulated requests'
(`tests.bundles.far_gate`: every request is flagged at its first step) serves flagged requests
with the operator's safe action, never gives them up, and reports the gate in each result."""

from __future__ import annotations

import pytest

from orca_method.thresholds import NEVER
from orca_serve.settings.contract import (
    XARG_GIVE_UP_MU,
    XARG_LAM,
    XARG_SHIFT_ALPHA,
    XARG_SHIFT_GIVE_UP_ALPHA,
    OrcaResult,
)
from orca_serve.settings.xargs import encode_lam
from tests.bundles import far_gate
from tests.core_sim import DIM, gated_sim_bundle, run_requests


@pytest.fixture(scope="module")
def gated_path(tmp_path_factory):
    return gated_sim_bundle(tmp_path_factory.mktemp("gated") / "bundle.json", far_gate(DIM))


def _run(path, requests: dict[str, dict], **cfg):
    sims, raw = run_requests(path, requests, **cfg)
    return sims, {k: OrcaResult.from_wire(v) for k, v in raw.items()}


def test_a_flagged_request_reasons_in_full_and_never_gives_up(gated_path):
    now = {XARG_LAM: 0.0}  # lambda 0 stops every ungated request at its first step
    sims, res = _run(gated_path, {
        "flagged": dict(now),
        "flagged-two-sided": {**now, XARG_GIVE_UP_MU: 0.2},  # would give up at step 1 too
        "ungated": {**now, XARG_SHIFT_ALPHA: 0, "orca_answer_budget": 4},
    }, defaults={"shift_action": "full"})
    for name in ("flagged", "flagged-two-sided"):
        r = res[name]
        assert r.shift_flagged and r.shift_alpha == 0.05, name
        assert r.shift_pvalue == pytest.approx(1 / 40), name  # above every calibration score
        # full reasoning: until the end-of-max_tokens guard closes it ("budget"), not the probe
        assert not r.stopped_early and r.stop_reason == "budget" and r.give_up_step is None, name
        assert r.steps_scored > 1 and r.ended == "full", name
    r = res["ungated"]
    assert r.stopped_early and r.stop_step == 1
    assert r.shift_alpha is None and "shift_flagged" not in r.to_dict()
    assert len(sims["ungated"].out) < len(sims["flagged"].out)


@pytest.mark.parametrize("defaults", [{"shift_action": "strict"}, {}])
def test_strict_serves_the_most_conservative_lambda(gated_path, defaults):
    """`strict`, the default: a flagged request runs the bundle's largest lambda*."""
    _, res = _run(gated_path, {"r": {XARG_LAM: 0.0}}, defaults=defaults)
    r = res["r"]
    assert r.shift_flagged
    # the table's largest lambda* (0.75) from the gate's step on: never below it
    assert not r.stopped_early or r.scores[r.stop_step - 1] >= 0.75


def test_action_off_and_alpha_defaults(gated_path):
    _, res = _run(gated_path, {"r": {XARG_LAM: 0.0}}, defaults={"shift_action": "off"})
    assert res["r"].stopped_early and res["r"].shift_alpha is None
    _, res = _run(gated_path, {"r": {XARG_LAM: 0.0}}, defaults={"shift_alpha": 0.2})
    assert res["r"].shift_alpha == 0.2 and res["r"].shift_flagged


def test_a_request_barred_at_the_give_up_level_only_stops_but_never_gives_up(gated_path):
    """Two levels. Every request's p-value is 1/40: above a stop level of 0.02 (not flagged: its
    own lambda), at most a give-up level of 0.05 (barred: it never gives up)."""
    levels = {XARG_SHIFT_ALPHA: 0.02, XARG_SHIFT_GIVE_UP_ALPHA: 0.05}
    never, gives_up = {XARG_LAM: encode_lam(NEVER)}, {XARG_GIVE_UP_MU: 0.2}  # at step 1
    _, res = _run(gated_path, {
        "barred": {**never, **gives_up, **levels},
        "one-level": {**never, **gives_up, XARG_SHIFT_ALPHA: 0.02},
        "stops": {XARG_LAM: 0.0, **gives_up, **levels},
    })
    r = res["barred"]
    assert not r.shift_flagged and r.shift_barred and r.shift_pvalue == pytest.approx(1 / 40)
    assert (r.shift_alpha, r.shift_give_up_alpha) == (0.02, 0.05)
    assert r.give_up_step is None and r.ended == "full" and r.steps_scored > 1
    # the bundle has no give-up level: the request's alpha on both sides, as before the field;
    # at 0.02 of 39 calibration scores neither side can flag, so the gate does not run at all
    r = res["one-level"]
    assert r.shift_alpha is None and r.give_up_step == 1 and r.ended == "gave_up"
    r = res["stops"]  # not flagged: its own lambda (0) stops it at its first step
    assert r.shift_barred and r.stopped_early and r.stop_step == 1


def test_the_engine_default_give_up_level(gated_path):
    """--orca-shift-give-up-alpha reaches the engine as a default, like --orca-shift-alpha."""
    _, res = _run(gated_path, {"r": {XARG_LAM: encode_lam(NEVER), XARG_GIVE_UP_MU: 0.2}},
                  defaults={"shift_alpha": 0.02, "shift_give_up_alpha": 0.05})
    r = res["r"]
    assert (r.shift_alpha, r.shift_give_up_alpha) == (0.02, 0.05)
    assert r.shift_barred and not r.shift_flagged and r.give_up_step is None
