"""One definition of each rule on a request's client-settable orca settings, read by both sides.

The server checks a body's `orca` object and its `orca_*` entries of `vllm_xargs`
(orca_serve/settings/field.py, answering 400); the engine checks the extra_args that reach it
(`orca_serve.settings.xargs.validate_xargs`, for requests that never passed the server too: offline
`LLM` users). Both call the rules here, so the range of delta, the policy names, the answer
budget's bounds and what `enabled` accepts cannot drift between them, and both word a refusal
the same way (`refusal`): only the place named differs ('orca.delta', 'vllm_xargs.orca_delta',
'orca_delta').

A rule is checked in one of two spellings: `strict`, the `orca` object's JSON types (a number is
a JSON number, `enabled` a JSON bool); or the xargs' (vllm_xargs carry no bools: `enabled` is 0/1;
numbers may come as numeric strings, as vLLM's extra_args allow). Plain Python (no vLLM, no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orca_method.errors import cut, shown
from orca_method.thresholds import GROUP_NAME_MAX
from orca_serve.settings.contract import MAX_ANSWER_BUDGET, POLICIES, Policy


def refusal(where: str, message: str) -> str:
    """A rule's message for the setting at `where` (the one wording both sides use)."""
    return f"'{cut(where)}' {message}"


def number(v: Any, strict: bool) -> float:
    """A number: a JSON number (strict), or also a numeric string (xargs); never a bool."""
    if isinstance(v, bool) or not isinstance(v, (int, float) if strict else (int, float, str)):
        raise ValueError(f"must be a number, got {shown(v)}")  # noqa: TRY004 - vLLM: 400
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"must be a number, got {shown(v)}") from None


def integer(v: Any, strict: bool) -> int:
    """An integer: a JSON integer (strict); or also an integral float, a digit string or a bool
    as 0/1 (xargs, as vLLM may hand them on)."""
    if strict:
        if type(v) is not int:
            raise ValueError(f"must be an integer, got {shown(v)}")
        return v
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    raise ValueError(f"must be an integer, got {shown(v)}")


def _enabled(v: Any, strict: bool) -> bool:
    if strict:
        if not isinstance(v, bool):
            raise ValueError(f"must be true or false, got {shown(v)}")
        return v
    try:
        on = integer(v, strict=False)
    except ValueError:
        on = -1
    if on not in (0, 1):
        raise ValueError(f"must be 0 or 1, got {shown(v)}")
    return bool(on)


def _delta(v: Any, strict: bool) -> float:
    d = number(v, strict)
    if not 0 < d < 1:
        raise ValueError(f"must be a number in (0, 1), got {shown(v)}")
    return d


def _policy(v: Any, strict: bool) -> Policy:
    if not isinstance(v, str) or v not in POLICIES:
        raise ValueError(f"must be one of {', '.join(repr(p) for p in POLICIES)}, "
                         f"got {shown(v)}")
    return Policy(v)


def _answer_budget(v: Any, strict: bool) -> int:
    n = integer(v, strict)
    if not 0 <= n <= MAX_ANSWER_BUDGET:
        raise ValueError(f"must be an integer in [0, {MAX_ANSWER_BUDGET}], got {shown(v)}")
    return n


def _alpha(v: Any, strict: bool) -> float:
    a = number(v, strict)
    if not 0 <= a < 1:
        raise ValueError(f"must be a number in [0, 1) (0: no shift gate), got {shown(v)}")
    return a


def _group(v: Any, strict: bool) -> str:
    if not isinstance(v, str) or not 1 <= len(v) <= GROUP_NAME_MAX:
        raise ValueError(f"must be a string of 1 to {GROUP_NAME_MAX} characters, "
                         f"got {shown(v)}")
    return v


def _samples(v: Any, strict: bool) -> int:
    k = integer(v, strict)
    if k < 2:
        raise ValueError(f"must be an integer >= 2 (the samples one vote is taken over), "
                         f"got {shown(v)}")
    return k


@dataclass(frozen=True)
class Rule:
    """One setting's rule: `check(value, strict)` returns it normalised or raises ValueError
    (naming no place); `schema` is the JSON schema of what the `orca` object accepts (OpenAPI)."""

    check: Callable[[Any, bool], Any]
    schema: dict[str, Any]


ENABLED = Rule(_enabled, {"type": "boolean"})
DELTA = Rule(_delta, {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1})
POLICY = Rule(_policy, {"type": "string", "enum": list(POLICIES)})
SHIFT_ALPHA = Rule(_alpha, {"type": "number", "minimum": 0, "exclusiveMaximum": 1})
ANSWER_BUDGET = Rule(_answer_budget, {"type": "integer", "minimum": 0,
                                      "maximum": MAX_ANSWER_BUDGET})
GROUP = Rule(_group, {"type": "string", "minLength": 1, "maxLength": GROUP_NAME_MAX})
# server-side only (no xarg: the engine runs each sample as a plain request): the k samples of one
# voted answer; its upper bound is the bundle's consensus block's (`resolve`)
SAMPLES = Rule(_samples, {"type": "integer", "minimum": 2})
# the client-settable settings, by their `orca` field name (their xargs: contract.XARG_FIELDS)
RULES = {"enabled": ENABLED, "delta": DELTA, "policy": POLICY, "answer_budget": ANSWER_BUDGET,
         "shift_alpha": SHIFT_ALPHA, "shift_give_up_alpha": SHIFT_ALPHA, "group": GROUP}
