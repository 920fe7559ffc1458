"""The one codec of a request's settings on the wire: `OrcaSettings` (the same frozen type on
both sides) into the `vllm_xargs` the server writes (`encode_settings`), and back from the
`SamplingParams.extra_args` vLLM hands the engine (`decode_settings`, then `on_deployment` for
what depends on the bundle the request joins); their checks (`validate_xargs`, the front end's
HTTP 400). Names and defaults are `orca_serve.settings.contract`'s, the client-settable
settings' rules `orca_serve.settings.rules`' (the server's too); plain Python (no vLLM, no
torch).

The server resolves a request's settings (defaults, delta -> lambda*) once
(`orca_serve.settings.resolve`) and encodes them here. A request that reaches the engine without
the server (offline `LLM`, a stock vLLM server) is resolved in the engine, through the same
`resolve_lam`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import Any

from orca_method.errors import shown
from orca_method.shift_gate import give_up_level
from orca_method.thresholds import NEVER, lam_to_json
from orca_serve.settings.contract import (
    XARG_ALARM,
    XARG_ANSWER_BUDGET,
    XARG_BUNDLE,
    XARG_DELTA,
    XARG_ENABLED,
    XARG_FIELDS,
    XARG_GIVE_UP_MU,
    XARG_GROUP,
    XARG_KEY,
    XARG_LAM,
    XARG_N,
    XARG_POLICY,
    XARG_RECORD,
    XARG_RESERVE,
    XARG_SEED,
    XARG_SHIFT_ALPHA,
    XARG_SHIFT_GIVE_UP_ALPHA,
    OrcaSettings,
    Policy,
    RequestDefaults,
)
from orca_serve.settings.rules import RULES, integer, number, refusal

# the integer xargs the server or the plugin set (the client-settable ones have their rules)
_INT_XARGS = (XARG_RECORD, XARG_RESERVE, XARG_N, XARG_ALARM)


def resolve_lam(lam_of: Callable[..., float], delta: float, group: str | None = None) -> float:
    """lambda*(delta) from a bundle's `lam` (inf: never stop), of `group`'s table when given
    (a group the bundle knows). The one place a delta becomes a threshold: the server calls it
    per request, the engine only for requests without orca_lam."""
    return float(lam_of(float(delta)) if group is None else lam_of(float(delta), group))


def encode_lam(lam: float | None) -> float | str:
    """lambda* as an xarg value: a finite float, or "inf" for NEVER (JSON has no infinity)."""
    v = lam_to_json(lam)
    return "inf" if v is None else v


def decode_lam(v: Any) -> float:
    """An `orca_lam` xarg as lambda* (NEVER for "inf"); ValueError unless a number in [0, 1]
    or NEVER: scores are probabilities, so any other threshold is a mistake, not a setting."""
    lam = _as_float(XARG_LAM, v)
    if not (0.0 <= lam <= 1.0 or lam == NEVER):
        raise ValueError(refusal(XARG_LAM, f"must be in [0, 1] or \"inf\" (never), got {shown(v)}"))
    return lam


def decode_mu(v: Any) -> float:
    """An `orca_give_up_mu` xarg as mu*: a number in [0, 1] (ValueError otherwise)."""
    mu = _as_float(XARG_GIVE_UP_MU, v)
    if not 0.0 <= mu <= 1.0:
        raise ValueError(refusal(XARG_GIVE_UP_MU, f"must be in [0, 1], got {shown(v)}"))
    return mu


def as_int(name: str, v: Any) -> int:
    """An integer xarg, as the rules read xargs (`orca_serve.settings.rules.integer`)."""
    try:
        return integer(v, strict=False)
    except ValueError as e:
        raise ValueError(refusal(name, str(e))) from None


def _as_float(name: str, v: Any) -> float:
    try:
        return number(v, strict=False)
    except ValueError as e:
        raise ValueError(refusal(name, str(e))) from None


def validate_xargs(xa: dict[str, Any] | None, n: int = 1, seed: int | None = None) -> None:
    """Check a request's orca_* extra_args (ValueError: vLLM answers HTTP 400).

    Runs in the front end, for every request: the server's (already checked there, by the same
    rules) and those that reach the engine without it (offline `LLM`). The client-settable ones
    are checked by their rules (orca_serve/settings/rules.py), worded as the server words them; the
    ones the server or the plugin set, here. With n > 1 vLLM copies these params into n child
    requests; `orca_n` tells each child that it is one (its index then comes from the engine's
    request id, or from its seed minus `orca_seed`).
    """
    if not xa:
        return
    for field, name in XARG_FIELDS.items():
        if name in xa:
            try:
                RULES[field].check(xa[name], False)
            except ValueError as e:
                raise ValueError(refusal(name, str(e))) from None
    if XARG_SHIFT_ALPHA in xa and XARG_SHIFT_GIVE_UP_ALPHA in xa:  # both the request's own
        try:
            give_up_level(float(xa[XARG_SHIFT_ALPHA]), float(xa[XARG_SHIFT_GIVE_UP_ALPHA]))
        except ValueError as e:
            raise ValueError(refusal(XARG_SHIFT_GIVE_UP_ALPHA, str(e))) from None
    for name in (XARG_KEY, XARG_BUNDLE):
        if name in xa and not isinstance(xa[name], str):
            raise ValueError(refusal(name, f"must be a string, got {shown(xa[name])}"))
    for name in _INT_XARGS:
        if name in xa:
            v = as_int(name, xa[name])
            if name in (XARG_RECORD, XARG_ALARM) and v not in (0, 1):
                raise ValueError(refusal(name, f"must be 0 or 1, got {shown(xa[name])}"))
            if v < 0:
                raise ValueError(refusal(name, f"must be >= 0, got {shown(xa[name])}"))
    if XARG_SEED in xa:  # any integer: vLLM's seeds may be negative
        as_int(XARG_SEED, xa[XARG_SEED])
    if XARG_LAM in xa:
        decode_lam(xa[XARG_LAM])
    if XARG_GIVE_UP_MU in xa:
        decode_mu(xa[XARG_GIVE_UP_MU])
    if n > 1:
        xa[XARG_N] = int(n)
        if seed is not None:
            xa[XARG_SEED] = int(seed)


def encode_settings(s: OrcaSettings) -> dict[str, str | int | float]:
    """A request's settings as the engine reads them (`vllm_xargs`; `decode_settings` reads
    them back): written once per request, by the server. Only what the engine acts on travels
    (`OrcaSettings`); an audited request travels as shadow, recorded, never giving up."""
    out: dict[str, str | int | float] = {} if s.key is None else {XARG_KEY: s.key}
    out[XARG_ENABLED] = int(s.enabled)
    if s.enabled:
        out[XARG_DELTA] = float(s.delta)  # type: ignore[arg-type]
        out[XARG_POLICY] = str(Policy.SHADOW if s.audited else s.policy)
        out[XARG_LAM] = encode_lam(s.lam)
        if s.bundle is not None:  # the engine joins this bundle's deployment
            out[XARG_BUNDLE] = s.bundle
        if s.audited:
            out[XARG_RECORD] = 1
        elif s.give_up_mu is not None:  # an audited request runs to the end: no give-up
            out[XARG_GIVE_UP_MU] = float(s.give_up_mu)
        if s.answer_budget is not None:
            out[XARG_ANSWER_BUDGET] = int(s.answer_budget)
        if s.shift_alpha is not None:
            out[XARG_SHIFT_ALPHA] = float(s.shift_alpha)
        if s.shift_give_up_alpha is not None:
            out[XARG_SHIFT_GIVE_UP_ALPHA] = float(s.shift_give_up_alpha)
        if s.group is not None:
            out[XARG_GROUP] = s.group
    if not s.alarm:  # its gate decision does not feed the gate alarm
        out[XARG_ALARM] = 0
    return out


def decode_settings(xa: Mapping[str, Any] | None, defaults: RequestDefaults, *,
                    record: bool) -> OrcaSettings:
    """A request's settings from its extra_args (checked already: `validate_xargs`), the
    engine's defaults for what they leave out: the codec's other half (`encode_settings`), for
    the server's requests and for those that reach the engine without it (offline `LLM`).

    What depends on the deployment the request joins is left to `on_deployment`: whether orca
    runs at all (a bundle that scores), the bundle's default delta, lambda* when `orca_lam` is
    absent, and the gate level of a request that sets none (a group the bundle knows is not
    gated). `shift_alpha` is therefore the request's own here (None: not set).
    """
    xa = xa or {}
    delta, reserve = xa.get(XARG_DELTA, defaults.delta), xa.get(XARG_RESERVE)
    alpha = xa.get(XARG_SHIFT_ALPHA)
    give_up_alpha = xa.get(XARG_SHIFT_GIVE_UP_ALPHA, defaults.shift_give_up_alpha)
    bundle = xa.get(XARG_BUNDLE)
    return OrcaSettings(
        key=xa.get(XARG_KEY), n=int(xa.get(XARG_N, 1)),
        seed=as_int(XARG_SEED, xa[XARG_SEED]) if XARG_SEED in xa else None,
        record=bool(as_int(XARG_RECORD, xa.get(XARG_RECORD, record))),
        enabled=bool(as_int(XARG_ENABLED, xa.get(XARG_ENABLED, int(defaults.enabled)))),
        policy=Policy(xa.get(XARG_POLICY, defaults.policy)),
        delta=None if delta is None else float(delta),
        lam=decode_lam(xa[XARG_LAM]) if XARG_LAM in xa else None,
        answer_budget=int(xa.get(XARG_ANSWER_BUDGET, defaults.answer_budget)),
        reserve=None if reserve is None else int(reserve),
        give_up_mu=decode_mu(xa[XARG_GIVE_UP_MU]) if XARG_GIVE_UP_MU in xa else None,
        shift_alpha=None if alpha is None else float(alpha),
        shift_give_up_alpha=None if give_up_alpha is None else float(give_up_alpha),
        group=xa.get(XARG_GROUP, defaults.group), bundle=None if bundle is None else str(bundle),
        alarm=bool(as_int(XARG_ALARM, xa.get(XARG_ALARM, 1))))


def on_deployment(s: OrcaSettings, defaults: RequestDefaults, *,
                  lam_of: Callable[..., float] | None, default_delta: float | None,
                  groups: Collection[str] = ()) -> OrcaSettings:
    """The settings `s` (`decode_settings`) run with on a deployment: `lam_of`/`default_delta`
    come from its bundle (None: record mode only, or the bundle the request names is no longer
    loaded), `groups` are the groups it has tables for.

    The server's `orca_lam` wins; otherwise lambda* is resolved here with `resolve_lam`, from
    the table of the request's group when it is one of `groups`, and such a request is not gated
    unless it sets `orca_shift_alpha` itself (as the server resolves it). A delta outside the
    bundle's table is refused as the server refuses it: the request runs without early stopping
    and `refused` says why (the engine cannot answer 400).
    """
    known = s.group in groups
    enabled = s.enabled and lam_of is not None
    delta = lam = refused = None
    if enabled:
        delta = s.delta if s.delta is not None else default_delta
        lam = s.lam
        if lam is None:
            try:
                lam = resolve_lam(lam_of, delta,  # type: ignore[arg-type]
                                  s.group if known else None)
            except Exception as e:  # noqa: BLE001 - the bundle's own words (BundleError)
                enabled, refused = False, str(e)
    alpha = s.shift_alpha if s.shift_alpha is not None else (
        0.0 if known else defaults.shift_alpha)
    return replace(s, enabled=enabled, delta=delta, lam=lam, refused=refused,
                   give_up_mu=s.give_up_mu if enabled else None,
                   shift_alpha=None if alpha is None else float(alpha))
