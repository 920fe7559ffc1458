"""The per-request `orca` field: validation, server defaults, and mapping to vLLM's `vllm_xargs`.

A client asks for early stopping in one of two ways (both may be mixed, but a setting may not be
given twice):

    {"orca": {"enabled": true, "delta": 0.05, "policy": "answer", "answer_budget": 64}}
    {"vllm_xargs": {"orca_enabled": 1, "orca_delta": 0.05, "orca_policy": "answer",
                    "orca_answer_budget": 64}}

The server removes `orca` and builds the request's `OrcaSettings` once (the body's field, its
rules, the server's defaults, the bundle's or the live audit's lambda*, a fresh `orca_key`); the
xargs codec writes them into `vllm_xargs`, which vLLM hands to the engine-side plugin as
`SamplingParams.extra_args`, read back there into the same type. Everything here is plain
Python (no vLLM import) so it is unit-tested without an engine.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from pydantic import ValidationError

from orca_method.bundle import Bundle, BundleError
from orca_method.outcomes import GiveUpPolicy, Source
from orca_method.shift_gate import give_up_level
from orca_method.thresholds import NEVER, lam_to_json
from orca_serve.settings.contract import (
    DEFAULTS,
    XARG_FIELDS,
    XARG_SHIFT_GIVE_UP_ALPHA,
    DeltaSource,
    OrcaSettings,
    Policy,
    VoteSettings,
)
from orca_serve.settings.effort import DEFAULT_EFFORT_MAP, effort_delta
from orca_serve.settings.field import (
    GiveUpFields,
    OrcaFields,
    OrcaRequestError,
    from_xargs,
    strip_orca_xargs,
    validation_message,
)
from orca_serve.settings.xargs import encode_settings, resolve_lam


@dataclass(frozen=True)
class OrcaDefaults:
    """Server-wide defaults (from the CLI and the bundle; unset ones are contract.DEFAULTS)."""

    enabled: bool = DEFAULTS.enabled
    delta: float | None = DEFAULTS.delta  # set from the bundle whenever enabled
    policy: Policy = DEFAULTS.policy
    answer_budget: int | None = None  # None: the plugin's own default (DEFAULTS)
    effort_map: dict[str, str | float] = field(default_factory=lambda: dict(DEFAULT_EFFORT_MAP))
    give_up_delta: float | None = None  # --orca-give-up-delta: None = requests do not give up
    give_up_policy: GiveUpPolicy = DEFAULTS.give_up_policy  # what a given-up request returns
    shift_alpha: float | None = DEFAULTS.shift_alpha  # --orca-shift-alpha (None: the bundle's)
    # --orca-shift-give-up-alpha (None: the bundle's)
    shift_give_up_alpha: float | None = DEFAULTS.shift_give_up_alpha
    # --orca-vote-waves: the launch schedule of orca.samples (None: all at once); the bundle's
    # consensus block is certified for it (`checks.bundle.check_vote_waves`)
    vote_waves: tuple[int, ...] | None = None


class Thresholds(Protocol):
    """Where an enabled request's lambda* and mu* come from, asked once per request: the bundle
    (`BundleThresholds`), or the live audit's guards (`orca_serve.live_audit`), which may serve
    a recalibrated or a never-stop lambda, turn give-up off, and pick requests to audit."""

    def lam(self, delta: float) -> tuple[float, Source]:
        """(lambda*, its source) for `delta`; BundleError for a delta outside the table."""
        ...

    def mu(self, give_up_delta: float) -> tuple[float, Source]:
        """(mu*, its source) for `give_up_delta`, GIVE_UP_NEVER: never gives up; BundleError
        for a give-up delta outside the bundle's give-up table."""
        ...

    def admit(self, settings: OrcaSettings, body: dict[str, Any]) -> OrcaSettings:
        """The settings the request runs with (audited or not)."""
        ...


@dataclass(frozen=True)
class BundleThresholds:
    """lambda* from the bundle's table (its main one, or `group`'s when the bundle knows that
    group: source "group"), every request as it asked."""

    bundle: Bundle
    group: str | None = None

    def lam(self, delta: float) -> tuple[float, Source]:
        known = self.bundle.group(self.group) is not None
        return (resolve_lam(self.bundle.lam, delta, self.group if known else None),
                Source.GROUP if known else Source.BUNDLE)

    def mu(self, give_up_delta: float) -> tuple[float, Source]:
        known = self.bundle.group(self.group) is not None
        return (self.bundle.mu(give_up_delta, self.group if known else None),
                Source.GROUP if known else Source.BUNDLE)

    def admit(self, settings: OrcaSettings, body: dict[str, Any]) -> OrcaSettings:
        return settings


def new_key() -> str:
    return f"orca-{uuid.uuid4().hex}"


def prompt_count(body: dict[str, Any]) -> int:
    """How many engine requests a /v1/completions body makes (one per prompt)."""
    for name in ("prompt", "prompt_embeds"):
        p = body.get(name)
        if isinstance(p, list) and p and isinstance(p[0], (str, list, bytes)):
            return len(p)
    return 1


def resolve(body: dict[str, Any], defaults: OrcaDefaults, bundle: Bundle | None,
            *, thresholds: Thresholds | None = None,
            check: Callable[[dict[str, Any]], None] | None = None, completions: bool = False,
            effort: str | None = None, thinking_budget: int | None = None
            ) -> tuple[dict[str, Any], OrcaSettings | None]:
    """Validate a request body's orca settings; return (rewritten body, settings).

    The settings are resolved completely before they are written into `vllm_xargs`, once:
    lambda*, mu* and the audit's pick come from `thresholds` (the bundle's table when None).
    `check`: the API's own refusals (OrcaRequestError) of a request orca runs on, made before
    the audit may pick it.

    `effort`: the request's reasoning effort (wherever its API carries it), mapped to a delta by
    `defaults.effort_map` unless the request sets `delta` or `enabled` itself (`orca_serve.settings.effort`).
    `thinking_budget`: vLLM's own `thinking_token_budget` of the request, kept for the report.
    Settings is None when the server has no bundle and the request does not ask for orca (then
    the body is passed on untouched: plain vLLM). Raises OrcaRequestError for anything malformed.
    """
    raw = body.get("orca", None)
    if raw is not None and not isinstance(raw, dict):
        raise OrcaRequestError(f"'orca' must be an object, got {type(raw).__name__}", "orca")
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        return body, None  # not ours to judge: vLLM answers with its own validation error
    given_x = from_xargs(xargs or {})
    given = dict(raw or {})
    both = sorted(set(given) & set(given_x))
    if both:
        raise OrcaRequestError(f"'{both[0]}' is given both in 'orca' and as "
                               f"'vllm_xargs.{XARG_FIELDS[both[0]]}'; give it once",
                               f"orca.{both[0]}")
    try:  # the xargs' values passed their rules in from_xargs (normalised: they pass again)
        fields = OrcaFields.model_validate({**given_x, **given})
    except ValidationError as e:
        msg, param = validation_message(e, "orca")
        raise OrcaRequestError(msg, param) from None

    out = {k: v for k, v in body.items() if k != "orca"}
    asked = raw is not None or bool(given_x)
    if fields.enabled is False and bundle is None:
        # One rule with or without a bundle: `enabled: false` switches orca off whatever else the
        # object holds (those fields were type-checked above, but not against a bundle).
        return strip_orca_xargs(out), None
    if bundle is None:
        if asked:
            raise OrcaRequestError("this server runs without a calibration bundle (start "
                                   "orca-serve with --calib), so 'orca' settings cannot apply",
                                   "orca")
        return body, None

    enabled = defaults.enabled if fields.enabled is None else fields.enabled
    delta = defaults.delta if fields.delta is None else float(fields.delta)
    source = DeltaSource.SERVER if fields.delta is None else DeltaSource.REQUEST
    target = defaults.effort_map.get(effort) if effort is not None else None
    if target is not None and fields.delta is None:  # an explicit delta wins over the effort
        mapped = effort_delta(target, bundle.deltas(), bundle.default_delta)
        if mapped is not None:
            delta, source = mapped, DeltaSource.EFFORT
        elif fields.enabled is None:  # "off", unless the request switched orca on itself
            enabled, source = False, DeltaSource.EFFORT
    n = body.get("n") or 1
    if not isinstance(n, int) or isinstance(n, bool):
        n = 1  # vLLM rejects it
    common = {"n": n, "bundle": bundle.checksum, "delta_source": source,
              "effort": effort if source == DeltaSource.EFFORT else None,
              "thinking_budget": thinking_budget}
    if not enabled:
        if fields.samples is not None:
            raise _samples_need_orca(effort if source == DeltaSource.EFFORT else None)
        settings = OrcaSettings(key=new_key(), enabled=False, **common)
    else:
        # a group the bundle knows is served by its own table, certified on its own calibration
        # traces; the live audit's guard watches the main (mixture) table's traffic and leaves
        # it alone (docs/METHOD.md section 12)
        known = bundle.group(fields.group) is not None
        guard = BundleThresholds(bundle, fields.group) if known else (
            thresholds or BundleThresholds(bundle))
        try:
            lam, lam_source = guard.lam(delta)
        except BundleError as e:
            param = ("vllm_xargs.orca_delta" if "delta" in given_x
                     else "reasoning_effort" if source == DeltaSource.EFFORT else "orca.delta")
            raise OrcaRequestError(str(e), param) from None
        if completions and prompt_count(body) > 1:
            raise OrcaRequestError("orca early stopping takes one prompt per /v1/completions "
                                   "request (send the prompts as separate requests, or disable "
                                   "orca with \"orca\": {\"enabled\": false})", "prompt")
        if check is not None:
            check(body)
        _check_levels(fields, defaults, bundle, "vllm_xargs" if "shift_give_up_alpha" in given_x
                      else "orca")
        settings = OrcaSettings(
            key=new_key(), enabled=True, delta=delta,
            policy=defaults.policy if fields.policy is None else fields.policy,
            lam=lam, lam_source=lam_source,
            answer_budget=(defaults.answer_budget if fields.answer_budget is None
                           else fields.answer_budget),
            shift_alpha=fields.shift_alpha, shift_give_up_alpha=fields.shift_give_up_alpha,
            group=fields.group, group_known=known,
            **_give_up(fields.give_up, defaults, bundle, guard), **common)
        if fields.samples is not None:
            # t is certified on samples stopped at lambda* alone: a vote's samples never give
            # up, run to their end when no t applies, and are not audited (docs/SERVE.md)
            _check_votable(settings, fields)
            vote = _vote(fields.samples, delta, body, bundle)
            settings = replace(settings, vote=vote, give_up_delta=None, give_up_mu=None,
                               give_up_policy=None,
                               **({} if vote.t is not None else {"lam": NEVER}))
        else:
            settings = guard.admit(settings, out)
        if settings.lam_source in (Source.AUDIT, Source.GROUP):
            # lambda* recalibrated on the live audits certifies today's traffic, a group's
            # lambda* its group's; the bundle's gate would flag that very traffic
            # (docs/METHOD.md sections 11 and 12)
            settings = replace(settings, shift_alpha=0.0)
    new_xargs = {k: v for k, v in (xargs or {}).items() if not k.startswith("orca_")}
    new_xargs.update(encode_settings(settings))
    out["vllm_xargs"] = new_xargs
    return out, settings


def _samples_need_orca(effort: str | None) -> OrcaRequestError:
    """The refusal of `orca.samples` with orca off. `effort`: the reasoning effort that switched
    it off (the effort map's `off`, `xhigh` and `max` by default): the client never disabled
    orca itself, so the message says what did and what wins over it."""
    why = ("" if effort is None else f", and reasoning effort '{effort}' switches it off on this "
           "server: add \"enabled\": true or a 'delta' to 'orca' to vote")
    return OrcaRequestError("'orca.samples' votes over ORCA-stopped samples: it needs orca "
                            f"enabled{why}", "orca.samples")


def _check_levels(fields: OrcaFields, defaults: OrcaDefaults, bundle: Bundle, where: str) -> None:
    """A give-up level the request sets itself must be at least the stop level it runs with
    (its own, the server's or the bundle's): a flagged request never gives up, so a lower one
    would mean nothing (`orca_method.shift_gate.give_up_level`). A default give-up level below a
    request's own stop level is raised to it (`ShiftGate.levels`), not refused."""
    if fields.shift_give_up_alpha is None or bundle.shift_gate is None:
        return
    alpha = next(a for a in (fields.shift_alpha, defaults.shift_alpha, bundle.shift_gate.alpha)
                 if a is not None)
    try:
        give_up_level(alpha, fields.shift_give_up_alpha)
    except ValueError as e:
        param = (f"vllm_xargs.{XARG_SHIFT_GIVE_UP_ALPHA}" if where == "vllm_xargs"
                 else "orca.shift_give_up_alpha")
        raise OrcaRequestError(f"'{param}' is {fields.shift_give_up_alpha:g}: {e}", param) from None


def _check_votable(settings: OrcaSettings, fields: OrcaFields) -> None:
    """Refuse `orca.samples` with what leaves the vote nothing certified to count: t* is
    certified on samples that stop at lambda* and then answer, so a policy that does not stop
    them (shadow), or stops them without an answer (stop), or an answer budget of 0, would vote
    on other samples (a probe: `stop` settled on a null answer, 3 votes of 4); an explicit
    `give_up` would be dropped (a vote's samples never give up)."""
    rule = settings.policy.rule
    if not (rule.acts and rule.answers):
        whose = "" if fields.policy is not None else " (this server's --orca-policy)"
        raise OrcaRequestError(f"'orca.samples' votes over answers given after ORCA's stop, "
                               f"and policy '{settings.policy}'{whose} "
                               f"{'gives none' if rule.acts else 'never stops'}: use policy "
                               "'answer'", "orca.policy" if fields.policy else "orca.samples")
    if settings.answer_budget == 0:
        raise OrcaRequestError("'orca.samples' votes over answers given after ORCA's stop, and "
                               "an answer budget of 0 leaves none", "orca.answer_budget")
    if fields.give_up is not None:
        raise OrcaRequestError("a vote's samples never give up (t* is certified on samples "
                               "stopped at lambda* alone): send 'give_up' without "
                               "'orca.samples'", "orca.give_up")


def _vote(k: int, delta: float, body: dict[str, Any], bundle: Bundle) -> VoteSettings:
    """The vote of `orca.samples: k` at the request's per-sample `delta`: the consensus row for
    that delta with the smallest delta_vote. Raises OrcaRequestError for a bundle without a
    consensus block, a k beyond the block's, no row for the delta, `n` besides, or a malformed
    stream request (`_check_vote_stream`)."""
    block = bundle.consensus
    if block is None:
        raise OrcaRequestError("this server's bundle has no consensus block, so 'orca.samples' "
                               "cannot apply; calibrate one with calibrate.consensus "
                               "(docs/CALIBRATE.md)", "orca.samples")
    if k > block.samples:
        raise OrcaRequestError(f"'orca.samples' is {k}, but the bundle's consensus rule is "
                               f"certified for groups of {block.samples} samples at most",
                               "orca.samples")
    n = body.get("n")
    if n not in (None, 1):
        raise OrcaRequestError("'orca.samples' returns one voted answer: send it without 'n'",
                               "n")
    _check_vote_stream(body)
    rows = [r for r in block.rows if abs(r.delta - delta) <= 1e-9]
    if not rows:
        raise OrcaRequestError(f"the bundle's consensus rule has no row for delta {delta:g} "
                               f"(it has {sorted({r.delta for r in block.rows})})", "orca.delta")
    row = min(rows, key=lambda r: r.delta_vote)
    # t is certified for groups of exactly block.samples; a smaller group waits for all its k
    t = None if row.t is None or k != block.samples else float(row.t)
    return VoteSettings(k=k, t=t, delta_vote=row.delta_vote, weighting=block.weighting,
                        waves=(k,) if t is None else block.schedule,
                        confident_tokens=None if t is None else row.confident_tokens)


def _check_vote_stream(body: dict[str, Any]) -> None:
    """A voted request's `stream` and `stream_options`, checked here because vLLM never sees
    them: its samples run unstreamed and the middleware streams the voted answer
    (`orca_serve.api_server.vote_stream`). `stream` is a JSON bool; `stream_options` an object
    whose `include_usage` is a bool, and only with `"stream": true` (vLLM's own rule)."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise OrcaRequestError(f"'stream' must be true or false, got {json.dumps(stream)}",
                               "stream")
    if options is None:
        return
    usage = options.get("include_usage") if isinstance(options, dict) else None
    if not isinstance(options, dict) or not isinstance(usage, (bool, type(None))):
        raise OrcaRequestError("'stream_options' must be an object whose 'include_usage' is "
                               f"true or false, got {json.dumps(options)}", "stream_options")
    if options and not stream:
        raise OrcaRequestError("'stream_options' can only be given with \"stream\": true",
                               "stream_options")


def _give_up(asked: GiveUpFields | None, defaults: OrcaDefaults, bundle: Bundle,
             guard: Thresholds) -> dict[str, Any]:
    """A request's give-up settings: on when it asks (`orca.give_up`) or the server's default
    is set, unless it says `enabled: false`; the delta is the request's, else the server's,
    else the bundle's default; mu* is `guard`'s, decided here once (a known group's own, which
    never gives up without one; the live audit's give-up guard turns it off after its alarm).
    Raises OrcaRequestError for a bundle without give-up or a delta it has no mu* for."""
    on = defaults.give_up_delta is not None or asked is not None
    if asked is not None and asked.enabled is not None:
        on = asked.enabled
    if not on:
        return {}
    if bundle.give_up is None:
        raise OrcaRequestError("this server's bundle has no give-up threshold (a one-sided "
                               "bundle, schema version 1), so 'orca.give_up' cannot apply; "
                               "calibrate one with calibrate.give_up", "orca.give_up")
    delta = asked.delta if asked is not None and asked.delta is not None else (
        defaults.give_up_delta if defaults.give_up_delta is not None
        else bundle.give_up.default_delta)
    try:
        mu, source = guard.mu(delta)
    except BundleError as e:
        raise OrcaRequestError(str(e), "orca.give_up.delta") from None
    return {"give_up_delta": float(delta), "give_up_mu": lam_to_json(mu),
            "give_up_policy": defaults.give_up_policy, "give_up_source": source}


