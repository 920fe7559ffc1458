"""The request contract shared by server and plugin (orca_serve.settings.contract): no vLLM needed."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from orca_serve.settings.contract import (
    DEFAULTS,
    POLICIES,
    XARG_BUNDLE,
    XARG_LAM,
    XARG_N,
    XARG_SEED,
    OrcaResult,
    OrcaSettings,
    Policy,
    ShiftAction,
    child_key,
    safe_lam,
    to_wire,
)
from orca_method.bundle import load_bundle
from orca_method.outcomes import GiveUpPolicy
from orca_method.risk import cumulative, stop_indices
from orca_serve.settings.field import OrcaRequestError
from orca_serve.settings.resolve import OrcaDefaults, resolve
from orca_serve.settings.xargs import (
    decode_settings,
    encode_lam,
    encode_settings,
    validate_xargs,
)
from tests.core_sim import engine_settings

LAMS = {0.05: math.inf, 0.1: 0.6, 0.2: 0.4}


def lam_of(delta: float) -> float:
    if delta not in LAMS:
        raise ValueError(f"delta {delta} has no calibrated lambda*")
    return LAMS[delta]


def test_child_keys():
    assert [child_key("k", i, 3) for i in range(3)] == ["k", "k/1", "k/2"]
    assert child_key("k", 0, 1) == "k"


def test_validate_xargs_marks_children_and_refuses_bad_values():
    xa = {"orca_key": "k"}
    validate_xargs(xa, n=3, seed=7)
    assert xa[XARG_N] == 3 and xa[XARG_SEED] == 7
    for bad in ({"orca_policy": "later"}, {"orca_enabled": 2}, {"orca_delta": "x"},
                {"orca_delta": 1.5}, {"orca_answer_budget": -1}, {"orca_key": 3},
                {XARG_LAM: "nan"}, {XARG_LAM: [1]}, {XARG_LAM: 5.0}, {XARG_LAM: -3},
                {XARG_LAM: "-inf"}, {XARG_BUNDLE: 5}, {XARG_SEED: "x"}, {XARG_SEED: 1.5}):
        with pytest.raises(ValueError, match="orca_"):
            validate_xargs(dict(bad))
    for good in (0, 1, 0.5, "0.25", "inf", math.inf):  # a probability, or never
        validate_xargs({XARG_LAM: good})


def test_lambda_resolution_server_value_wins_engine_resolves_the_rest():
    spec = engine_settings({XARG_LAM: "inf", "orca_delta": 0.2}, DEFAULTS, record=False,
                           lam_of=lam_of, default_delta=0.1)
    assert spec.lam == math.inf and spec.delta == 0.2  # the server's resolution, not 0.4
    spec = engine_settings({"orca_delta": 0.2}, DEFAULTS, record=False, lam_of=lam_of,
                           default_delta=0.1)
    assert spec.lam == 0.4 and spec.enabled and spec.policy == "answer"
    spec = engine_settings({"orca_delta": 0.3}, DEFAULTS, record=False, lam_of=lam_of,
                           default_delta=0.1)
    assert not spec.enabled and spec.lam is None and spec.refused == str(_refusal(0.3))
    spec = engine_settings({}, DEFAULTS, record=True, lam_of=None, default_delta=None)
    assert not spec.enabled and spec.record and spec.lam is None


def test_the_settings_codec_reads_back_what_the_server_wrote():
    """One type, one codec: what the server encodes (through JSON, as vLLM's extra_args carry
    it) the engine decodes into the same type, every field it acts on as it was; an audited
    request arrives as what it means to the engine (shadow, recorded, never giving up)."""
    s = OrcaSettings(key="k", enabled=True, delta=0.1, policy=Policy.STOP, lam=math.inf,
                     answer_budget=32, bundle="c" * 64, give_up_mu=0.2, shift_alpha=0.05,
                     shift_give_up_alpha=0.1, group="g", alarm=False, effort="low")
    back = decode_settings(json.loads(json.dumps(encode_settings(s))), DEFAULTS, record=False)
    travels = ("key", "enabled", "delta", "policy", "lam", "answer_budget", "bundle",
               "give_up_mu", "shift_alpha", "shift_give_up_alpha", "group", "alarm", "record")
    assert [getattr(back, f) for f in travels] == [getattr(s, f) for f in travels]
    assert back.effort is None  # the server's report's, not the engine's
    audited = decode_settings(encode_settings(replace(s, audited=True)), DEFAULTS, record=False)
    assert audited.policy is Policy.SHADOW and audited.record and audited.give_up_mu is None
    off = decode_settings(encode_settings(OrcaSettings(key="k", enabled=False)), DEFAULTS,
                          record=False)
    assert not off.enabled and off.lam is None


def test_server_passes_the_lambda_it_resolved():
    class FakeBundle:  # what resolve() uses of a Bundle
        lam = staticmethod(lam_of)
        checksum = "c" * 64
        group = staticmethod(lambda name: None)  # it knows no group

    d = OrcaDefaults(delta=0.1)
    out, s = resolve({"orca": {"delta": 0.2}}, d, FakeBundle())  # type: ignore[arg-type]
    assert out["vllm_xargs"][XARG_LAM] == 0.4 == s.lam
    # the engine joins the deployment of the bundle lambda* came from (hot reload)
    assert out["vllm_xargs"][XARG_BUNDLE] == "c" * 64 == s.bundle
    out, s = resolve({"orca": {"delta": 0.05}}, d, FakeBundle())  # type: ignore[arg-type]
    assert out["vllm_xargs"][XARG_LAM] == "inf" == encode_lam(math.inf) and s.lam == math.inf
    with pytest.raises(OrcaRequestError, match="set by the server"):
        resolve({"vllm_xargs": {XARG_LAM: 0.1}}, d, FakeBundle())  # type: ignore[arg-type]
    with pytest.raises(OrcaRequestError, match="set by the server"):
        resolve({"vllm_xargs": {XARG_BUNDLE: "x"}}, d, FakeBundle())  # type: ignore[arg-type]


def _refusal(delta: float) -> Exception:
    try:
        lam_of(delta)
    except ValueError as e:
        return e
    raise AssertionError(f"{delta} is in the table")


def test_an_unknown_delta_gets_the_same_answer_on_both_sides():
    """The server refuses it (400) in the bundle's words; the engine, reached without the
    server, refuses it in the same words and runs without early stopping (no fallback)."""
    from orca_method.bundle import BundleError

    def bundle_lam(delta: float) -> float:
        try:
            return lam_of(delta)
        except ValueError as e:
            raise BundleError(str(e)) from None

    class FakeBundle:
        lam = staticmethod(bundle_lam)
        checksum = "c" * 64
        group = staticmethod(lambda name: None)  # it knows no group

    with pytest.raises(OrcaRequestError) as server:
        resolve({"orca": {"delta": 0.3}}, OrcaDefaults(delta=0.1), FakeBundle())  # type: ignore[arg-type]
    engine = engine_settings({"orca_delta": 0.3}, DEFAULTS, record=False, lam_of=bundle_lam,
                             default_delta=0.1)
    assert server.value.message == engine.refused == "delta 0.3 has no calibrated lambda*"
    assert server.value.param == "orca.delta" and not engine.enabled


def test_policy_rules():
    """One rule per policy: what a stop does is asked of the rule, never of the name."""
    assert [(p.rule.acts, p.rule.answers) for p in Policy] == [
        (True, True), (True, False), (False, False)]
    assert POLICIES == ("answer", "stop", "shadow") and Policy("shadow") is Policy.SHADOW
    assert engine_settings({"orca_policy": "stop"}, DEFAULTS, record=False, lam_of=lam_of,
                           default_delta=0.1).policy is Policy.STOP


def test_result_wire_round_trip():
    """`from_wire` reads back what the engine sends (`to_wire` of `to_dict`): every field, the
    arrays as numpy arrays, never-stop lambda as inf; unknown keys (newer engines) ignored."""
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    r = OrcaResult(enabled=True, policy=Policy.SHADOW, delta=0.05, lam=math.inf,
                   steps_scored=2, stopped_early=False, stop_step=None, would_stop_step=2,
                   last_score=0.7, scores=[0.1, 0.7], reasoning_tokens=9, forced_tokens=[],
                   stop_reason=None, index=1, notes=["n"], give_up_mu=0.2, give_up_step=None,
                   last_give_up_score=0.1, step_embeddings=arr, step_tokens=[4, 5],
                   step_token_ids=[[1], [2]], prompt_token_ids=[7], output_token_ids=[8, 9])
    wire = to_wire(r.to_dict())
    assert wire["lam"] is None and isinstance(wire["step_embeddings"]["data"], bytes)
    back = OrcaResult.from_wire({**wire, "from_a_newer_engine": 1})
    np.testing.assert_array_equal(back.step_embeddings, arr)
    back.step_embeddings = r.step_embeddings = None
    assert back == r and back.lam == math.inf and back.policy is Policy.SHADOW
    off = OrcaResult.from_wire({**wire, "enabled": False})
    assert off.lam is None  # orca did not run: no threshold at all


def test_result_wire_form():
    base = {"enabled": True, "policy": "stop", "delta": 0.1, "lam": 0.6, "steps_scored": 2,
            "stopped_early": True, "stop_step": 2, "would_stop_step": 2, "last_score": 0.7,
            "scores": [0.1, 0.7], "reasoning_tokens": 9, "forced_tokens": [5],
            "stop_reason": "probe", "index": 0, "bundle_checksum": "c" * 64,
            "reasoning_closed": True, "prompt_reasoning_tokens": 1}
    d = OrcaResult(**base).to_dict()
    assert d == base  # no notes, error or record fields when there are none
    arr = np.zeros((2, 3), dtype=np.float32)
    d = OrcaResult(**base, notes=["n"], step_embeddings=arr, step_tokens=[4, 5],
                   step_token_ids=[[1], [2]]).to_dict()
    assert d["notes"] == ["n"] and d["step_embeddings"] is arr and d["step_tokens"] == [4, 5]


def test_the_engine_config_crosses_vllm_as_json_and_comes_back_typed():
    """`additional_config["orca"]` is the wire form of one EngineConfig: through JSON (what
    --additional-config carries) and back it is the same object, its words enums again; a
    misspelt key or default is refused with its name instead of served as the default."""
    import json

    from orca_serve.settings.engine_config import EngineConfig

    cfg = EngineConfig(bundle="/b.json", record=True, segmentation={"delimiter": "\n\n"},
                       defaults=replace(DEFAULTS, enabled=False, policy=Policy.STOP,
                                        give_up_policy=GiveUpPolicy.MESSAGE,
                                        shift_action=ShiftAction.STRICT, shift_alpha=0.2),
                       max_results=5)
    back = EngineConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.defaults.policy is Policy.STOP
    assert back.defaults.shift_action is ShiftAction.STRICT
    assert EngineConfig.from_dict(None) == EngineConfig() and EngineConfig().defaults == DEFAULTS
    partial = EngineConfig.from_dict({"bundle": "/b.json", "defaults": {"policy": "shadow"}})
    assert partial.defaults == replace(DEFAULTS, policy=Policy.SHADOW)
    with pytest.raises(ValueError, match="unknown keys bundel"):
        EngineConfig.from_dict({"bundel": "/b.json"})
    with pytest.raises(ValueError, match="unknown request defaults polcy"):
        EngineConfig.from_dict({"defaults": {"polcy": "stop"}})
    with pytest.raises(ValueError, match="'later' is not a valid Policy"):
        EngineConfig.from_dict({"defaults": {"policy": "later"}})
    with pytest.raises(ValueError, match="normalization must be one of"):
        EngineConfig(normalization="l3")


def test_reload_answers_round_trip_and_refuse_anything_else():
    from orca_serve.settings.contract import ReloadAnswer

    for a in (ReloadAnswer(checksum="c"), ReloadAnswer(live=("c", None)),
              ReloadAnswer(error="loading the bundle failed: x")):
        assert ReloadAnswer.from_wire(a.to_wire()) == a
    assert ReloadAnswer(live=("c",)).to_wire() == {"live": ["c"]}
    for bad in (None, "c", {"checksum": "c", "extra": 1}):
        with pytest.raises(ValueError, match="unexpected answer from an engine worker"):
            ReloadAnswer.from_wire(bad)


@pytest.mark.parametrize("bundle", ["orca_serve/demo/bundle.json",
                                    "orca_serve/demo/long/bundle.json"])
def test_strict_keeps_every_in_distribution_guarantee(bundle):
    """The default shift action serves a flagged request the bundle's largest lambda*. That
    threshold is at least every lambda*, a trace's first crossing of a higher threshold comes no
    earlier, and under cumulative labels a later stop is never wrong where an earlier one was
    right: per trace the loss under `strict` is at most the loss under lambda*(delta), whatever
    the gate flags, so the in-distribution risk stays <= delta (docs/METHOD.md section 11)."""
    assert DEFAULTS.shift_action is ShiftAction.STRICT
    b = load_bundle(bundle)
    safe = safe_lam(b, DEFAULTS.shift_action)
    assert all(safe >= b.lam(r.delta) for r in b.ltt.rows)
    rng = np.random.default_rng(34)
    scores = [rng.uniform(size=int(rng.integers(2, 40))) for _ in range(400)]  # [T_i] each
    labels = [cumulative(rng.uniform(size=len(s)) < 0.1) for s in scores]
    lams = np.array([b.lam(r.delta) for r in b.ltt.rows] + [safe])
    tau = stop_indices(scores, lams)  # [n_lambdas + 1, n]
    loss = np.array([[1 - y[t] for y, t in zip(labels, row)] for row in tau])
    assert (tau[-1] >= tau[:-1]).all() and (loss[-1] <= loss[:-1]).all()
    assert (tau[-1] > tau[:-1]).any()  # the property is not vacuous: strict does stop later
