"""A request's `orca.group` (docs/SERVER.md, docs/METHOD.md section 12): a group the bundle has
a table for takes its lambda* (and mu*), is not gated and is left alone by the audit's guard;
any other group is served as a request without one (the mixture's table, through the gate) and
is told so. The server side through `orca_serve.settings.resolve.resolve`; the engine side, reached
without the server, through the simulated core (tests/core_sim.py)."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest

from orca_serve.settings.contract import (
    XARG_GIVE_UP_MU,
    XARG_GROUP,
    XARG_KEY,
    XARG_LAM,
    XARG_SHIFT_ALPHA,
    OrcaResult,
    OrcaSettings,
    RequestDefaults,
)
from orca_serve.settings.field import OrcaRequestError
from orca_serve.api_server.report import orca_object
from orca_serve.settings.resolve import OrcaDefaults, resolve
from tests.bundles import far_gate, tiny_bundle, with_give_up, with_groups, write_bundle
from tests.core_sim import (
    DIM,
    ID,
    WINDOW,
    SimRequest,
    engine_settings,
    make_core,
    run,
    sim_probe,
)
from tests.servers import orca_result

# main table: 0.05 never, 0.1 at 0.75; "shifted" never stops at 0.05 and stops later at 0.1;
# "easy" stops at once (lambda* 0) at 0.1; only "shifted" has its own mu*
GROUPS = {"shifted": {"lam": [(0.05, None), (0.1, 0.97)], "mu": [(0.05, None), (0.1, 0.05)]},
          "easy": {"lam": [(0.05, 0.9), (0.1, 0.0)]}}
BUNDLE = with_groups(with_give_up(
    tiny_bundle(sim_probe(), [(0.05, None), (0.1, 0.75)], vocab=ID, window=WINDOW,
                default_delta=0.1, name="fake", hidden_size=DIM),
    [(0.05, 0.1), (0.1, 0.2)], bias=-2.0), GROUPS).model_copy(
        update={"shift_gate": far_gate(DIM)})
DEFAULTS = OrcaDefaults(enabled=True, delta=0.1)


def _resolve(orca: dict[str, Any], **kw: Any) -> tuple[dict[str, Any], OrcaSettings]:
    out, s = resolve({"model": "m", "messages": [], "orca": orca}, DEFAULTS, BUNDLE, **kw)
    assert s is not None
    return out["vllm_xargs"], s


def test_a_known_group_takes_its_own_table_and_is_not_gated():
    x, s = _resolve({"group": "shifted"})
    assert s.lam == 0.97 == x[XARG_LAM] and s.lam_source == "group"
    assert s.group == "shifted" == x[XARG_GROUP] and s.group_known
    assert s.shift_alpha == 0.0 == x[XARG_SHIFT_ALPHA]  # its table certifies it: no gate
    x, s = _resolve({"group": "easy", "delta": 0.05})
    assert s.lam == 0.9 and s.lam_source == "group"
    _, s = _resolve({"group": "shifted", "delta": 0.05})
    assert s.lam == math.inf


def test_an_unknown_group_is_served_with_the_mixture_table_through_the_gate():
    x, s = _resolve({"group": "new-product"})
    assert s.lam == 0.75 and s.lam_source == "bundle" and not s.group_known
    assert XARG_SHIFT_ALPHA not in x  # the bundle's gate level: it is gated
    assert x[XARG_GROUP] == "new-product"
    x, s = _resolve({})
    assert s.group is None and XARG_GROUP not in x and s.lam == 0.75


def test_give_up_takes_the_groups_mu_and_never_gives_up_without_one():
    x, s = _resolve({"group": "shifted", "give_up": {"delta": 0.1}})
    assert s.give_up_mu == 0.05 == x[XARG_GIVE_UP_MU] and s.give_up_source == "group"
    x, s = _resolve({"group": "easy", "give_up": {"delta": 0.1}})
    assert s.give_up_mu is None and XARG_GIVE_UP_MU not in x and s.give_up_source == "group"
    x, s = _resolve({"group": "other", "give_up": {"delta": 0.1}})
    assert s.give_up_mu == 0.2 and s.give_up_source == "bundle"
    with pytest.raises(OrcaRequestError, match="no calibrated mu"):
        _resolve({"group": "easy", "give_up": {"delta": 0.3}})


def test_vllm_xargs_spelling_and_refusals():
    out, s = resolve({"prompt": "p", "vllm_xargs": {"orca_group": "easy"}}, DEFAULTS, BUNDLE)
    assert s.lam == 0.0 and s.lam_source == "group"
    with pytest.raises(OrcaRequestError, match="given both") as e:
        resolve({"orca": {"group": "a"}, "vllm_xargs": {"orca_group": "b"}}, DEFAULTS, BUNDLE)
    assert e.value.param == "orca.group"
    for bad, param in ((7, "orca.group"), ("", "orca.group"), ("g" * 65, "orca.group")):
        with pytest.raises(OrcaRequestError, match="string of 1 to 64 characters") as e:
            _resolve({"group": bad})
        assert e.value.param == param
    with pytest.raises(OrcaRequestError, match="'vllm_xargs.orca_group' must be a string"):
        resolve({"prompt": "p", "vllm_xargs": {"orca_group": 3}}, DEFAULTS, BUNDLE)
    with pytest.raises(OrcaRequestError, match="no calibrated lambda"):
        _resolve({"group": "shifted", "delta": 0.2})


class _Guard:
    """A guard (the live audit's part `resolve` asks) that serves its own lambda and audits
    every request it admits: a known group must never reach it."""

    def lam(self, delta: float) -> tuple[float, str]:
        return 0.5, "audit"

    def admit(self, settings: OrcaSettings, body: dict[str, Any]) -> OrcaSettings:
        return replace(settings, audited=True)


def test_the_audit_guard_watches_the_mixture_only():
    _, s = _resolve({"group": "shifted"}, thresholds=_Guard())
    assert s.lam == 0.97 and s.lam_source == "group" and not s.audited
    _, s = _resolve({"group": "new"}, thresholds=_Guard())
    assert s.lam == 0.5 and s.lam_source == "audit" and s.audited


def test_the_orca_object_says_which_table_served_it():
    _, s = _resolve({"group": "shifted"})
    obj = orca_object(s, {0: orca_result(lam=0.97)})
    assert obj["group"] == "shifted" and obj["group_known"] is True
    assert obj["lambda_source"] == "group" and obj["lambda"] == 0.97
    _, s = _resolve({"group": "new"})
    obj = orca_object(s, {0: orca_result(lam=0.75)})
    assert obj["group"] == "new" and obj["group_known"] is False
    assert obj["lambda_source"] == "bundle"
    _, s = _resolve({})
    assert "group" not in orca_object(s, {0: orca_result()})


def test_the_engine_resolves_a_group_when_the_server_did_not():
    """An offline request (no orca_lam): lambda* of its known group's table, ungated; an
    unknown group: the main table, the bundle's gate level."""
    defaults = RequestDefaults(answer_budget=8)
    groups = tuple(BUNDLE.groups)
    s = engine_settings({XARG_GROUP: "shifted"}, defaults, record=False, lam_of=BUNDLE.lam,
                           default_delta=0.1, groups=groups)
    assert s.lam == 0.97 and s.shift_alpha == 0.0 and s.group == "shifted"
    s = engine_settings({XARG_GROUP: "shifted", XARG_SHIFT_ALPHA: 0.1}, defaults, record=False,
                           lam_of=BUNDLE.lam, default_delta=0.1, groups=groups)
    assert s.shift_alpha == 0.1  # its own level wins
    s = engine_settings({XARG_GROUP: "nope"}, defaults, record=False, lam_of=BUNDLE.lam,
                           default_delta=0.1, groups=groups)
    assert s.lam == 0.75 and s.shift_alpha is None


@pytest.fixture(scope="module")
def grouped_path(tmp_path_factory):
    return write_bundle(BUNDLE, tmp_path_factory.mktemp("grouped") / "bundle.json")


def test_the_core_serves_a_known_group_ungated_and_an_unknown_one_gated(grouped_path):
    """The simulated engine, requests without the server: the gate (fitted far from every
    request) flags the unknown group's request, which reasons in full; the known group "easy"
    (lambda* 0 at delta 0.1) is not gated and stops at its first step."""
    core = make_core(grouped_path, max_num_seqs=4)
    rng = random.Random(0)
    reqs = {"easy": {XARG_GROUP: "easy"}, "unknown": {XARG_GROUP: "unknown"}}
    sims = [SimRequest(k, rng, xa={XARG_KEY: k, **xa}, max_tokens=60, join_at=0)
            for k, xa in reqs.items()]
    run(core, sims)
    res = {k: OrcaResult.from_wire(v) for k, v in core.pop_results(list(reqs)).items()}
    easy, unknown = res["easy"], res["unknown"]
    assert easy.lam == 0.0 and easy.stopped_early and easy.stop_step == 1
    assert easy.shift_alpha is None  # the gate did not run for it
    assert unknown.lam == 0.75 and unknown.shift_flagged and not unknown.stopped_early
