"""One validation path for a request's orca settings: the server (the `orca` object and
`vllm_xargs`) and the engine (`validate_xargs`, what offline `LLM` users' extra_args meet) apply
the same rules (orca_serve/settings/rules.py) and refuse in the same words, naming their own place."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_serve.settings.contract import XARG_FIELDS
from orca_serve.settings.field import OrcaFields, OrcaRequestError, from_xargs
from orca_serve.settings.resolve import OrcaDefaults, resolve
from orca_serve.settings.xargs import validate_xargs
from tests.bundles import small_bundle

BUNDLE = small_bundle()
DEFAULTS = OrcaDefaults(enabled=True, delta=0.1)
# values of the right JSON type but out of range or choice: refused by every spelling alike
OUT_OF_RANGE = [("delta", 1.5), ("delta", 0), ("delta", -0.5), ("delta", 1),
                ("policy", "later"), ("policy", "ANSWER"), ("answer_budget", -1),
                ("answer_budget", 2**31), ("answer_budget", 2**64), ("group", ""),
                ("group", "g" * 65)]
# malformed in the xargs' spelling
BAD_XARGS = [*OUT_OF_RANGE, ("delta", "x"), ("delta", [0.1]), ("delta", True), ("delta", None),
             ("policy", 3), ("policy", ["stop"]), ("enabled", 2), ("enabled", "yes"),
             ("enabled", -1), ("enabled", 0.5), ("answer_budget", 1.5), ("answer_budget", "x"),
             ("answer_budget", {"n": 1}), ("delta", "y" * 10**5), ("group", 3),
             ("group", ["a"])]


def _server(body: dict) -> str | None:
    try:
        resolve({"messages": [], **body}, DEFAULTS, BUNDLE)
    except OrcaRequestError as e:
        return e.message
    return None


def _engine(xa: dict) -> str | None:
    try:
        validate_xargs(dict(xa))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("field, value", BAD_XARGS)
def test_server_and_engine_refuse_a_bad_xarg_in_the_same_words(field, value):
    xarg = XARG_FIELDS[field]
    engine = _engine({xarg: value})
    assert engine is not None and engine.startswith(f"'{xarg}' ")
    assert _server({"vllm_xargs": {xarg: value}}) == engine.replace(
        f"'{xarg}'", f"'vllm_xargs.{xarg}'", 1)
    assert len(engine) < 300  # a huge value is quoted cut


@pytest.mark.parametrize("field, value", OUT_OF_RANGE)
def test_the_orca_object_refuses_out_of_range_values_in_the_same_words(field, value):
    xarg = XARG_FIELDS[field]
    assert _server({"orca": {field: value}}) == _engine({xarg: value}).replace(
        f"'{xarg}'", f"'orca.{field}'", 1)


def test_the_give_up_objects_delta_is_the_requests_delta_rule():
    assert _server({"orca": {"give_up": {"delta": 1.5}}}) == _server(
        {"orca": {"delta": 1.5}}).replace("'orca.delta'", "'orca.give_up.delta'")


def test_the_openapi_schema_states_the_rules_bounds():
    props = OrcaFields.model_json_schema()["properties"]
    delta = props["delta"]["anyOf"][0]
    assert (delta["exclusiveMinimum"], delta["exclusiveMaximum"]) == (0, 1)
    assert props["policy"]["anyOf"][0]["enum"] == ["answer", "stop", "shadow"]
    assert props["answer_budget"]["anyOf"][0]["maximum"] == 2**31 - 1
    assert props["group"]["anyOf"][0] == {"type": "string", "minLength": 1, "maxLength": 64}


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**40),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                    st.sampled_from(["answer", "stop", "shadow", "0.1", "1", "0", "inf", "nan"]),
                    st.lists(st.integers(), max_size=2))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(list(XARG_FIELDS.values())), _VALUES, max_size=4))
def test_malformed_xargs_get_the_same_answer_on_both_sides(xa):
    """Whatever the client-settable xargs hold, the server's check (before the bundle is asked
    about the delta) accepts them exactly when the engine's does, with the same first refusal."""
    engine = _engine(xa)
    try:
        OrcaFields.model_validate(from_xargs(xa))
        server = None
    except OrcaRequestError as e:
        server = e.message
    expect = None if engine is None else engine.replace("'orca_", "'vllm_xargs.orca_", 1)
    assert server == expect, (xa, server, engine)
