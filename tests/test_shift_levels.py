"""The shift gate's two levels in the server's settings, without vLLM: the request's
`orca.shift_give_up_alpha` (and its xarg) reaches the engine, a give-up level below the stop
level it runs with is refused (the request's, or --orca-shift-give-up-alpha against the bundle
or --orca-shift-alpha), and the engine's defaults carry the server's option."""

from __future__ import annotations

import pytest

from orca_method.bundle import BundleError
from orca_method.outcomes import GiveUpPolicy
from orca_method.probe import Probe, ProbeSpec
from orca_serve.checks.bundle import check_options
from orca_serve.settings.contract import (
    DEFAULTS as ENGINE_DEFAULTS,
    XARG_SHIFT_ALPHA,
    XARG_SHIFT_GIVE_UP_ALPHA,
    RequestDefaults,
)
from orca_serve.settings.field import OrcaRequestError
from orca_serve.settings.resolve import OrcaDefaults, resolve
from orca_serve.settings.xargs import validate_xargs
from tests.bundles import far_gate, tiny_bundle
from tests.core_sim import engine_settings

HIDDEN = 16
ONE_LEVEL = tiny_bundle(Probe(ProbeSpec(dim=HIDDEN), seed=0), [(0.05, 0.5), (0.1, 0.7)],
                        shift_gate=far_gate(HIDDEN))  # alpha 0.05, no give-up level
TWO_LEVELS = ONE_LEVEL.model_copy(update={"shift_gate": ONE_LEVEL.shift_gate.model_copy(
    update={"alpha": 0.035, "give_up_alpha": 0.05})})
SERVER = OrcaDefaults(enabled=True, delta=0.05, policy="answer", answer_budget=None)


def _resolve(orca: dict, bundle=TWO_LEVELS, defaults=SERVER):
    return resolve({"messages": [], "orca": {"delta": 0.05, **orca}}, defaults, bundle)


def test_the_request_level_reaches_the_engine():
    out, s = _resolve({"shift_alpha": 0.02, "shift_give_up_alpha": 0.1})
    assert (s.shift_alpha, s.shift_give_up_alpha) == (0.02, 0.1)
    x = out["vllm_xargs"]
    assert x[XARG_SHIFT_ALPHA] == 0.02 and x[XARG_SHIFT_GIVE_UP_ALPHA] == 0.1
    s = engine_settings(x, ENGINE_DEFAULTS, record=False, lam_of=TWO_LEVELS.lam,
                           default_delta=0.05)
    assert (s.shift_alpha, s.shift_give_up_alpha) == (0.02, 0.1)
    # unset: nothing written, the engine's default (the bundle's) applies
    out, s = _resolve({})
    assert s.shift_give_up_alpha is None and XARG_SHIFT_GIVE_UP_ALPHA not in out["vllm_xargs"]
    s = engine_settings(out["vllm_xargs"], RequestDefaults(shift_give_up_alpha=0.2),
                           record=False, lam_of=TWO_LEVELS.lam, default_delta=0.05)
    assert s.shift_give_up_alpha == 0.2


@pytest.mark.parametrize("orca, stop", [
    ({"shift_give_up_alpha": 0.02}, 0.035),  # below the bundle's stop level
    ({"shift_alpha": 0.1, "shift_give_up_alpha": 0.05}, 0.1),  # below its own
])
def test_a_give_up_level_below_the_stop_level_is_refused(orca, stop):
    with pytest.raises(OrcaRequestError, match=f"at least the stop side's \\({stop:g}\\)") as e:
        _resolve(orca)
    assert e.value.param == "orca.shift_give_up_alpha"
    with pytest.raises(OrcaRequestError) as e:  # as an xarg: named as the client sent it
        resolve({"messages": [], "vllm_xargs": {f"orca_{k}": v for k, v in orca.items()}},
                SERVER, TWO_LEVELS)
    assert e.value.param == f"vllm_xargs.{XARG_SHIFT_GIVE_UP_ALPHA}"
    # against the server's stop level too
    with pytest.raises(OrcaRequestError, match="at least the stop side's \\(0.2\\)"):
        _resolve({"shift_give_up_alpha": 0.1},
                 defaults=OrcaDefaults(**{**SERVER.__dict__, "shift_alpha": 0.2}))
    # equal is one level, and alpha 0 (no gate) takes any
    _resolve({"shift_alpha": 0.1, "shift_give_up_alpha": 0.1})
    _resolve({"shift_alpha": 0, "shift_give_up_alpha": 0.01})


def test_the_server_option_is_checked_against_the_bundle_and_its_own_stop_level():
    kw = {"delta": None, "give_up_delta": None, "give_up_policy": GiveUpPolicy.GUESS,
          "effort_map": {}}
    check_options(TWO_LEVELS, **kw, shift_give_up_alpha=0.05)
    check_options(ONE_LEVEL, **kw, shift_give_up_alpha=0.05)
    with pytest.raises(BundleError, match="--orca-shift-give-up-alpha 0.04: .* the bundle's 0.05"):
        check_options(ONE_LEVEL, **kw, shift_give_up_alpha=0.04)
    with pytest.raises(BundleError, match="--orca-shift-alpha's 0.1"):
        check_options(TWO_LEVELS, **kw, shift_alpha=0.1, shift_give_up_alpha=0.05)


def test_an_old_bundle_has_one_level_whatever_the_request_sets():
    gate = ONE_LEVEL.load_gate()
    assert gate.levels() == (0.05, 0.05) and gate.levels(0.1) == (0.1, 0.1)
    two = TWO_LEVELS.load_gate()
    assert two.levels() == (0.035, 0.05) and two.levels(0.1) == (0.1, 0.1)


def test_the_engine_refuses_a_request_whose_own_levels_are_the_wrong_way_round():
    """Offline `LLM` requests reach the engine without the server: its front-end check refuses
    them in the server's words."""
    validate_xargs({XARG_SHIFT_ALPHA: 0.05, XARG_SHIFT_GIVE_UP_ALPHA: 0.1})
    with pytest.raises(ValueError, match="'orca_shift_give_up_alpha' .*at least the stop side's"):
        validate_xargs({XARG_SHIFT_ALPHA: 0.05, XARG_SHIFT_GIVE_UP_ALPHA: 0.02})
