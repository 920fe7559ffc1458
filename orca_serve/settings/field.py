"""The request body's `orca` field: its schema (also published in /openapi.json), its checks
and its one-line 400s, and the `orca_*` names a client may write into `vllm_xargs` instead.
Each setting is checked by its rule in orca_serve/settings/rules.py, the one the engine applies to
the extra_args that reach it (`orca_serve.settings.xargs.validate_xargs`). Plain Python (pydantic, no vLLM).
"""

from __future__ import annotations

from typing import Annotated, Any, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, WithJsonSchema

from orca_method.errors import cut, shown
from orca_serve.settings.contract import XARG_FIELDS, XARG_RESERVED, Policy
from orca_serve.settings.rules import (
    ANSWER_BUDGET,
    DELTA,
    ENABLED,
    GROUP,
    POLICY,
    RULES,
    SAMPLES,
    SHIFT_ALPHA,
    Rule,
    refusal,
)


class OrcaRequestError(ValueError):
    """A malformed `orca` request; becomes HTTP 400 in OpenAI's error format."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _checked(rule: Rule) -> tuple[BeforeValidator, WithJsonSchema]:
    """An optional `orca` field checked by `rule` in the JSON spelling (strict), documented by
    the rule's schema (or null: not set)."""
    return (BeforeValidator(lambda v: None if v is None else rule.check(v, True)),
            WithJsonSchema({"anyOf": [rule.schema, {"type": "null"}]}))


class GiveUpFields(BaseModel):
    """`orca.give_up`: give up on reasoning that will probably not end right, with risk
    `delta` (delta_2: P(giving up on a request that would have ended right); docs/METHOD.md
    section 9). `{}` takes the server's or the bundle's default delta; `enabled: false` turns
    a server default off."""

    model_config = ConfigDict(extra="forbid", strict=True)

    enabled: Annotated[bool | None, *_checked(ENABLED)] = None
    delta: Annotated[float | None, *_checked(DELTA)] = None


class OrcaFields(BaseModel):
    """The body field `orca` (all optional: missing settings take the server's defaults)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    enabled: Annotated[bool | None, *_checked(ENABLED)] = None
    delta: Annotated[float | None, *_checked(DELTA)] = None
    policy: Annotated[Policy | None, *_checked(POLICY)] = None
    answer_budget: Annotated[int | None, *_checked(ANSWER_BUDGET)] = None
    give_up: GiveUpFields | None = None
    # the shift gate's level for this request (0: no gate); None: the server's or the bundle's
    shift_alpha: Annotated[float | None, *_checked(SHIFT_ALPHA)] = None
    # the give-up side's level (at least the stop side's): a request whose p-value is at most it
    # never gives up; None: the server's or the bundle's
    shift_give_up_alpha: Annotated[float | None, *_checked(SHIFT_ALPHA)] = None
    # the operator's tag: a group the bundle knows takes its own lambda* (docs/METHOD.md 12)
    group: Annotated[str | None, *_checked(GROUP)] = None
    # one voted answer from k samples, each an ORCA request, the group stopped by the bundle's
    # consensus rule (docs/METHOD.md section 14, docs/SERVE.md "One voted answer")
    samples: Annotated[int | None, *_checked(SAMPLES)] = None


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    return cut(".".join(str(x) for x in loc))


def _holder(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The model whose field `loc` names: OrcaFields, or an object nested in it (`give_up`)."""
    model: type[BaseModel] = OrcaFields
    for part in loc[:-1]:
        model = next(t for t in get_args(model.model_fields[part].annotation)
                     if isinstance(t, type) and issubclass(t, BaseModel))
    return model


def validation_message(e: ValidationError, prefix: str) -> tuple[str, str]:
    """The first of `OrcaFields`' validation errors as (one-line message, param), worded as the
    rules word theirs."""
    err = e.errors()[0]
    loc = err["loc"]
    where = _fmt_loc(loc)
    param = f"{prefix}.{where}" if where else prefix
    if err["type"] == "extra_forbidden":
        allowed = ", ".join(_holder(loc).model_fields)
        obj = f"{prefix}.{_fmt_loc(loc[:-1])}" if len(loc) > 1 else prefix
        return f"unknown field '{param}'; allowed fields of '{obj}': {allowed}", param
    if err["type"] == "value_error":  # a rule's refusal (orca_serve/settings/rules.py)
        return refusal(param, err["msg"].removeprefix("Value error, ")), param
    if err["type"] == "model_type":  # a nested object (`give_up`) given as something else
        return refusal(param, f"must be an object, got {shown(err.get('input'))}"), param
    return f"invalid '{param}': {err['msg']} (got {shown(err.get('input'))})", param


def from_xargs(xargs: dict[str, Any]) -> dict[str, Any]:
    """The orca_* entries of vllm_xargs as `orca` field values, checked by the engine's rules in
    the engine's order (`validate_xargs`), so both name the same first refusal."""
    for name in xargs:
        if not name.startswith("orca_"):
            continue
        where = f"vllm_xargs.{cut(name)}"
        if name in XARG_RESERVED:
            raise OrcaRequestError(f"'{where}' is set by the server, not by clients", where)
        if name not in XARG_FIELDS.values():
            raise OrcaRequestError(f"unknown orca argument '{where}'; allowed: "
                                   f"{', '.join(XARG_FIELDS.values())}", where)
    out: dict[str, Any] = {}
    for key, name in XARG_FIELDS.items():
        if name in xargs:
            try:  # the xargs spelling, as the engine checks it (vllm_xargs carry no bools)
                out[key] = RULES[key].check(xargs[name], False)
            except ValueError as e:
                raise OrcaRequestError(refusal(f"vllm_xargs.{name}", str(e)),
                                       f"vllm_xargs.{name}") from None
    return out


def orca_param_in(body: dict[str, Any]) -> str | None:
    """Where a body asks for orca settings (`orca`, an `orca_*` entry of `vllm_xargs` or of the
    token API's `sampling_params.extra_args`), as the param to name in a 400; None if nowhere.

    Used on routes that cannot report what orca did: they refuse the settings instead of
    ignoring them.
    """
    if "orca" in body:
        return "orca"
    places = (("vllm_xargs", body.get("vllm_xargs")),)
    sampling = body.get("sampling_params")
    if isinstance(sampling, dict):
        places += (("sampling_params.extra_args", sampling.get("extra_args")),)
    for where, args in places:
        if isinstance(args, dict):
            for name in args:
                if isinstance(name, str) and name.startswith("orca_"):
                    return f"{where}.{name}"
    return None


def strip_orca_xargs(body: dict[str, Any]) -> dict[str, Any]:
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        rest = {k: v for k, v in xargs.items() if not k.startswith("orca_")}
        body = dict(body)
        if rest:
            body["vllm_xargs"] = rest
        else:
            body.pop("vllm_xargs")
    return body


def error_body(message: str, param: str | None = None, code: int = 400,
               err_type: str = "BadRequestError") -> dict[str, Any]:
    """OpenAI's error format, as vLLM writes it (ErrorResponse)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
