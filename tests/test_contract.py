"""The request contract shared by server and plugin (orca_serve.contract): no vLLM needed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from orca_serve.contract import (
    DEFAULTS,
    XARG_BUNDLE,
    XARG_LAM,
    XARG_N,
    XARG_SEED,
    OrcaResult,
    child_key,
    encode_lam,
    request_spec,
    validate_xargs,
)
from orca_serve.requests import OrcaDefaults, OrcaRequestError, resolve

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
                {XARG_LAM: "-inf"}, {XARG_BUNDLE: 5}):
        with pytest.raises(ValueError, match="orca_"):
            validate_xargs(dict(bad))
    for good in (0, 1, 0.5, "0.25", "inf", math.inf):  # a probability, or never
        validate_xargs({XARG_LAM: good})


def test_lambda_resolution_server_value_wins_engine_resolves_the_rest():
    spec = request_spec({XARG_LAM: "inf", "orca_delta": 0.2}, DEFAULTS, record=False,
                        lam_of=lam_of, default_delta=0.1)
    assert spec.lam == math.inf and spec.delta == 0.2  # the server's resolution, not 0.4
    spec = request_spec({"orca_delta": 0.2}, DEFAULTS, record=False, lam_of=lam_of,
                        default_delta=0.1)
    assert spec.lam == 0.4 and spec.enabled and spec.policy == "answer"
    spec = request_spec({"orca_delta": 0.3}, DEFAULTS, record=False, lam_of=lam_of,
                        default_delta=0.1)
    assert (spec.delta, spec.lam) == (0.1, 0.6) and "default delta" in spec.notes[0]
    spec = request_spec({}, DEFAULTS, record=True, lam_of=None, default_delta=None)
    assert not spec.enabled and spec.record and spec.lam is None


def test_server_passes_the_lambda_it_resolved():
    class FakeBundle:  # what resolve() uses of a Bundle
        lam = staticmethod(lam_of)
        checksum = "c" * 64

    d = OrcaDefaults(delta=0.1)
    out, s = resolve({"orca": {"delta": 0.2}}, d, FakeBundle())  # type: ignore[arg-type]
    assert out["vllm_xargs"][XARG_LAM] == 0.4 == s.lam
    # the engine joins the deployment of the bundle lambda* came from (hot reload)
    assert out["vllm_xargs"][XARG_BUNDLE] == "c" * 64 == s.bundle
    out, s = resolve({"orca": {"delta": 0.05}}, d, FakeBundle())  # type: ignore[arg-type]
    assert out["vllm_xargs"][XARG_LAM] == "inf" == encode_lam(math.inf) and s.lam is None
    with pytest.raises(OrcaRequestError, match="set by the server"):
        resolve({"vllm_xargs": {XARG_LAM: 0.1}}, d, FakeBundle())  # type: ignore[arg-type]
    with pytest.raises(OrcaRequestError, match="set by the server"):
        resolve({"vllm_xargs": {XARG_BUNDLE: "x"}}, d, FakeBundle())  # type: ignore[arg-type]


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
