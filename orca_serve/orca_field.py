"""The request body's `orca` field: its schema (also published in /openapi.json), its checks
and its one-line 400s, and the `orca_*` names a client may write into `vllm_xargs` instead.
Plain Python (pydantic, no vLLM)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orca_method.errors import cut, shown
from orca_serve.contract import MAX_ANSWER_BUDGET, POLICIES, XARG_FIELDS, XARG_RESERVED, Policy


class OrcaRequestError(ValueError):
    """A malformed `orca` request; becomes HTTP 400 in OpenAI's error format."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class GiveUpFields(BaseModel):
    """`orca.give_up`: give up on reasoning that will probably not end right, with risk
    `delta` (delta_2: P(giving up on a request that would have ended right); docs/METHOD.md
    section 9). `{}` takes the server's or the bundle's default delta; `enabled: false` turns
    a server default off."""

    model_config = ConfigDict(extra="forbid", strict=True)

    enabled: bool | None = None
    delta: float | None = Field(None, gt=0, lt=1)


class OrcaFields(BaseModel):
    """The body field `orca` (all optional: missing settings take the server's defaults)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    enabled: bool | None = None
    delta: float | None = Field(None, gt=0, lt=1)
    # not strict: a JSON string names the policy (the model is strict for everything else)
    policy: Policy | None = Field(None, strict=False)
    answer_budget: int | None = Field(None, ge=0, le=MAX_ANSWER_BUDGET)
    give_up: GiveUpFields | None = None


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    return cut(".".join(str(x) for x in loc))


def validation_message(e: ValidationError, prefix: str) -> tuple[str, str]:
    err = e.errors()[0]
    where = _fmt_loc(err["loc"])
    param = f"{prefix}.{where}" if where else prefix
    if err["type"] == "extra_forbidden":
        allowed = ", ".join(OrcaFields.model_fields)
        return f"unknown field '{param}'; allowed fields of '{prefix}': {allowed}", param
    if err["type"] in ("literal_error", "enum"):
        return (f"'{param}' must be one of {', '.join(repr(p) for p in POLICIES)}, "
                f"got {shown(err.get('input'))}"), param
    return f"invalid '{param}': {err['msg']} (got {shown(err.get('input'))})", param


def from_xargs(xargs: dict[str, Any]) -> dict[str, Any]:
    """The orca_* entries of vllm_xargs as `orca` field values (type-checked like `orca`)."""
    out: dict[str, Any] = {}
    by_xarg = {v: k for k, v in XARG_FIELDS.items()}
    for name, value in xargs.items():
        if not name.startswith("orca_"):
            continue
        name = cut(name)
        if name in XARG_RESERVED:
            raise OrcaRequestError(f"'vllm_xargs.{name}' is set by the server, not by clients",
                                   f"vllm_xargs.{name}")
        key = by_xarg.get(name)
        if key is None:
            raise OrcaRequestError(f"unknown orca argument 'vllm_xargs.{name}'; allowed: "
                                   f"{', '.join(XARG_FIELDS.values())}", f"vllm_xargs.{name}")
        if key == "enabled":
            # vllm_xargs carry no bools: 0/1 (a JSON bool is accepted as well)
            if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
                value = bool(value)
            else:
                raise OrcaRequestError(f"'vllm_xargs.{name}' must be 0 or 1, got {shown(value)}",
                                       f"vllm_xargs.{name}")
        out[key] = value
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
