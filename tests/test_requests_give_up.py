"""`orca.give_up` without an engine: resolution against a two-sided bundle, the xargs it
becomes (none for an audited request), the response's `give_up` and `ended`, and the metrics per
outcome."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from orca_method.probe import Probe, ProbeSpec
from orca_serve.settings.contract import XARG_GIVE_UP_MU
from orca_serve.metrics.prometheus import OrcaMetrics, outcome_of
from orca_serve.settings.field import OrcaRequestError
from orca_serve.api_server.report import choice_fields, orca_object
from orca_serve.settings.resolve import OrcaDefaults, resolve
from orca_serve.settings.xargs import encode_settings
from tests.bundles import tiny_bundle, with_give_up
from tests.servers import orca_result

ONE_SIDED = tiny_bundle(Probe(ProbeSpec(dim=16), seed=0), [(0.05, 0.5), (0.1, None)])
TWO_SIDED = with_give_up(ONE_SIDED, [(0.05, 0.3), (0.1, None)], default_delta=0.05)
DEFAULTS = OrcaDefaults(enabled=True, delta=0.05)


def settings(orca: dict | None, bundle=TWO_SIDED, defaults=DEFAULTS):
    body = {"messages": []} if orca is None else {"messages": [], "orca": orca}
    out, s = resolve(body, defaults, bundle)
    return out["vllm_xargs"], s


def test_give_up_is_off_by_default_and_on_per_request():
    xa, s = settings(None)
    assert XARG_GIVE_UP_MU not in xa and s.give_up_delta is None
    xa, s = settings({"give_up": {"delta": 0.05}})
    assert xa[XARG_GIVE_UP_MU] == 0.3 and s.give_up_delta == 0.05 and s.give_up_mu == 0.3
    xa, s = settings({"give_up": {}})  # the bundle's default give-up delta
    assert s.give_up_delta == 0.05 and xa[XARG_GIVE_UP_MU] == 0.3
    xa, s = settings({"give_up": {"delta": 0.1}})  # certified nothing: never gives up
    assert s.give_up_mu is None and XARG_GIVE_UP_MU not in xa


def test_the_server_default_and_a_request_turning_it_off():
    on = OrcaDefaults(enabled=True, delta=0.05, give_up_delta=0.05, give_up_policy="message")
    xa, s = settings(None, defaults=on)
    assert xa[XARG_GIVE_UP_MU] == 0.3 and s.give_up_policy == "message"
    xa, s = settings({"give_up": {"enabled": False}}, defaults=on)
    assert XARG_GIVE_UP_MU not in xa and s.give_up_delta is None


@pytest.mark.parametrize("orca, bundle, param, words", [
    ({"give_up": {"delta": 0.05}}, ONE_SIDED, "orca.give_up", "no give-up threshold"),
    ({"give_up": {"delta": 0.2}}, TWO_SIDED, "orca.give_up.delta", "no calibrated mu"),
    ({"give_up": {"delta": 1.5}}, TWO_SIDED, "orca.give_up.delta", r"a number in \(0, 1\)"),
    # the give-up object's own fields, not the orca object's
    ({"give_up": {"detla": 0.05}}, TWO_SIDED, "orca.give_up.detla",
     r"unknown field 'orca.give_up.detla'; allowed fields of 'orca.give_up': enabled, delta$"),
    ({"give_up": 0.05}, TWO_SIDED, "orca.give_up", r"^'orca.give_up' must be an object, got 0.05$"),
])
def test_malformed_give_up_is_a_one_line_400(orca, bundle, param, words):
    with pytest.raises(OrcaRequestError, match=words) as e:
        settings(orca, bundle=bundle)
    assert e.value.param == param and "\n" not in e.value.message


def test_an_audited_request_runs_to_the_end_without_giving_up():
    import dataclasses

    _, s = settings({"give_up": {"delta": 0.05}})
    audited = dataclasses.replace(s, audited=True)
    xa = encode_settings(audited)
    assert xa["orca_policy"] == "shadow" and XARG_GIVE_UP_MU not in xa
    assert orca_object(audited, {0: None})["give_up"]["active"] is False


def test_shadow_never_gives_up_and_says_so():
    """An explicit shadow request, and one the plugin ran as shadow (policy stop under
    ignore_eos, `notes`), report their give-up inactive: shadow never acts."""
    _, s = settings({"policy": "shadow", "give_up": {"delta": 0.05}})
    assert orca_object(s, {0: None})["give_up"]["active"] is False
    assert orca_object(s, {0: orca_result(policy="shadow")})["give_up"]["active"] is False
    _, s = settings({"policy": "stop", "give_up": {"delta": 0.05}})
    assert orca_object(s, {0: orca_result(policy="stop")})["give_up"]["active"] is True
    assert orca_object(s, {0: orca_result(policy="shadow")})["give_up"]["active"] is False


def test_no_certified_mu_is_reported_inactive():
    """A give-up block without a threshold (a live recalibration whose LTT certified no mu
    serves mu None: the request never gives up) says so rather than `active: true`."""
    import dataclasses

    _, s = settings({"policy": "stop", "give_up": {"delta": 0.05}})
    assert orca_object(s, {0: orca_result(policy="stop")})["give_up"]["active"] is True
    none = dataclasses.replace(s, give_up_mu=None)
    assert orca_object(none, {0: orca_result(policy="stop")})["give_up"]["active"] is False


def test_the_response_says_how_the_reasoning_ended():
    _, s = settings({"give_up": {"delta": 0.05}})
    r = orca_result(steps_scored=4, stop_reason="give_up", give_up_step=4, give_up_mu=0.3,
                    last_give_up_score=0.2, reasoning_tokens=30)
    o = orca_object(s, {0: r})
    assert o["ended"] == "gave_up" and o["give_up_step"] == 4 and o["last_give_up_score"] == 0.2
    assert o["thinking_ended_by"] == "orca_give_up"  # orca forced the end, not the model
    assert o["give_up"] == {"delta": 0.05, "mu": 0.3, "policy": "guess", "source": "bundle",
                            "active": True}
    assert choice_fields(orca_result(stopped_early=True, stop_reason="probe"))["ended"] == "early"
    assert choice_fields(orca_result(stop_reason="budget"))["ended"] == "full"
    assert "give_up_step" not in choice_fields(orca_result())  # one-sided: as before
    scored = orca_result(give_up_mu=0.3, last_give_up_score=0.2)  # two-sided, give-up not asked
    assert "last_give_up_score" not in orca_object(settings({})[1], {0: scored})
    assert choice_fields(None)["ended"] == "full"  # no result: it never stopped


def test_metrics_per_outcome():
    m = OrcaMetrics(CollectorRegistry())
    m.observe(orca_result(stop_reason="give_up", give_up_step=3, give_up_mu=0.3,
                          steps_scored=3, reasoning_tokens=25))
    m.observe(orca_result(stopped_early=True, stop_step=2, stop_reason="probe", steps_scored=2,
                          reasoning_tokens=15))
    m.observe(orca_result(steps_scored=5, reasoning_tokens=60))
    text = re.sub(r'\{model_name=""\}|,?model_name=""', "", generate_latest(m.registry).decode())
    text = text.replace("{,", "{")
    for line in ['orca_requests_total{outcome="gave_up"} 1.0',
                 'orca_requests_total{outcome="stopped_early"} 1.0',
                 'orca_ended_reasoning_tokens_total{ended="gave_up"} 25.0',
                 'orca_ended_reasoning_tokens_total{ended="early"} 15.0',
                 'orca_ended_reasoning_tokens_total{ended="full"} 60.0',
                 "orca_give_up_step_count 1.0", "orca_give_up_step_sum 3.0"]:
        assert line in text, line
    assert outcome_of(orca_result(stop_reason="give_up")) == "gave_up"
