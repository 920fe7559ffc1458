"""What the server says about a request's orca run: results fetched from the engine, and the
response's `orca` object built from them (typed `OrcaResult`s; JSON only here, at the edge).

No vLLM import: the engine is reached through the `rpc` the server hands in.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any

from orca_method.outcomes import Ended, Source
from orca_method.thresholds import lam_to_json
from orca_serve.api_server.apis import reasoning_spent, thinking_ended_by
from orca_serve.settings.contract import OrcaResult, OrcaSettings, Policy, merge_results

logger = logging.getLogger("orca_serve.api_server.server")

RPC_TIMEOUT_S = 30.0
NO_RESULT = "the engine reported no orca result for this request"


class ResultFetcher:
    """Fetches plugin results for many requests with few RPCs.

    Callers await `get(keys)`; keys asked for while an RPC is in flight are batched into the next
    one, so 64 requests finishing together cost a handful of collective_rpc calls, not 64.
    """

    def __init__(self, rpc: Callable[..., Any]) -> None:
        self._rpc = rpc  # async (method, args) -> list per worker
        self._pending: dict[str, list[asyncio.Future]] = {}
        self._task: asyncio.Task | None = None

    async def get(self, keys: list[str]) -> dict[str, OrcaResult]:
        loop = asyncio.get_running_loop()
        futs = []
        for k in keys:
            f = loop.create_future()
            self._pending.setdefault(k, []).append(f)
            futs.append(f)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush())
        values = await asyncio.gather(*futs)
        return {k: v for k, v in zip(keys, values) if v is not None}

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let requests finishing in the same tick join this batch
        while self._pending:
            batch, self._pending = self._pending, {}
            keys = list(batch)
            merged: dict[str, OrcaResult] = {}
            try:
                per_worker = await asyncio.wait_for(self._rpc("orca_results", (keys,)),
                                                    RPC_TIMEOUT_S)
                merged = {k: v for k, v in merge_results(per_worker).items() if k in batch}
            except Exception as e:  # noqa: BLE001 - a failed fetch must not fail the response
                logger.warning("orca: fetching results for %d request(s) failed: %r", len(keys), e)
            for k, futs in batch.items():
                for f in futs:
                    if not f.done():
                        f.set_result(merged.get(k))


def _score(v: float | None) -> float | None:
    return None if v is None or math.isinf(v) or math.isnan(v) else float(v)


def choice_fields(result: OrcaResult | None, bundle: str | None = None,
                  thinking_budget: int | None = None, give_up: bool = False) -> dict[str, Any]:
    """Per-choice part of the `orca` object from one plugin result (zeros when none came).
    `bundle`: the checksum the server resolved lambda* with; the engine must have served the
    request with the same bundle (an error says so otherwise). `thinking_budget`: the request's
    vLLM `thinking_token_budget` (`thinking_ended_by` says which of the two ended thinking).
    `give_up`: the request asked to give up, and its choices say where and at what score (the
    engine scores the give-up probe of a two-sided bundle for every request, asked or not)."""
    if result is None:
        return {"steps_scored": 0, "stopped_early": False, "stop_step": None,
                "would_stop_step": None, "last_score": None, "reasoning_tokens": 0,
                "forced_tokens": 0, "stop_reason": None, "ended": Ended.FULL,
                "thinking_ended_by": None, "error": NO_RESULT}
    r = result
    out: dict[str, Any] = {
        "steps_scored": r.steps_scored, "stopped_early": r.stopped_early,
        "stop_step": r.stop_step, "would_stop_step": r.would_stop_step,
        "last_score": _score(r.last_score), "reasoning_tokens": r.reasoning_tokens,
        "forced_tokens": len(r.forced_tokens), "stop_reason": r.stop_reason, "ended": r.ended,
        "thinking_ended_by": thinking_ended_by(r, thinking_budget),
    }
    if give_up:
        out["give_up_step"] = r.give_up_step
        out["last_give_up_score"] = _score(r.last_give_up_score)
    if r.shift_alpha is not None:  # the shift gate ran (pvalue None: it had not decided yet)
        out["shift"] = {"alpha": r.shift_alpha, "give_up_alpha": r.shift_give_up_alpha,
                        "pvalue": r.shift_pvalue, "flagged": r.shift_flagged,
                        "give_up_barred": r.shift_barred, "alarm": r.shift_alarm}
    if r.notes:
        out["notes"] = list(r.notes)
    if r.error:
        out["error"] = r.error
    if bundle is not None and r.bundle_checksum is not None and r.bundle_checksum != bundle:
        out["error"] = f"served by bundle {r.bundle_checksum}, resolved with bundle {bundle}"
    return out


def give_up_acts(settings: OrcaSettings, policy: Policy) -> bool:
    """Whether the request's give-up can end it (the response's `give_up.active`): not under a
    policy that never acts (shadow, what an audited request runs as: it runs to its end), nor
    when the audit's guard turned give-up off (source fallback), nor without a threshold (mu
    None: nothing was certified, e.g. a live recalibration whose LTT rejected every mu)."""
    return (policy.rule.acts and not settings.audited and settings.give_up_mu is not None
            and settings.give_up_source != Source.FALLBACK)


def orca_object(settings: OrcaSettings,
                results: dict[int, OrcaResult | None]) -> dict[str, Any]:
    """The response's `orca` object. n == 1: flat; n > 1: common fields + `choices` list."""
    effort = {} if settings.effort is None else {"reasoning_effort": settings.effort}
    if not settings.enabled:
        return {"enabled": False, **effort}
    obj: dict[str, Any] = {"enabled": True, "policy": settings.policy, "delta": settings.delta,
                           "delta_source": settings.delta_source, **effort,
                           "lambda": lam_to_json(settings.lam),
                           "lambda_source": settings.lam_source,
                           "bundle_checksum": settings.bundle}
    if settings.group is not None:  # which table served it: its group's, or the mixture's
        obj["group"] = settings.group
        obj["group_known"] = settings.group_known
    if settings.thinking_budget is not None:
        obj["thinking_token_budget"] = settings.thinking_budget
    if settings.audited:
        obj["audited"] = True
    if any(r is not None and r.shift_alarm for r in results.values()):
        obj["shift_alarm"] = True  # the engine's gate alarm served it as a flagged request
    if settings.answer_budget is not None:
        obj["answer_budget"] = settings.answer_budget
    if settings.n <= 1:
        r = results.get(0)
        if r is not None:
            obj["policy"] = r.policy  # the plugin may run another policy (see `notes`)
    if settings.give_up_delta is not None:
        obj["give_up"] = {"delta": settings.give_up_delta, "mu": lam_to_json(settings.give_up_mu),
                          "policy": settings.give_up_policy, "source": settings.give_up_source,
                          "active": give_up_acts(settings, Policy(obj["policy"]))}
    per_choice = {"bundle": settings.bundle, "thinking_budget": settings.thinking_budget,
                  "give_up": settings.give_up_delta is not None}
    if settings.n <= 1:
        obj.update(choice_fields(results.get(0), **per_choice))
    else:
        obj["choices"] = []
        for i, r in sorted(results.items()):
            c = {"index": i, **choice_fields(r, **per_choice)}
            if r is not None and r.policy != settings.policy:
                c["policy"] = r.policy
            obj["choices"].append(c)
    return obj


def reasoning_total(settings: OrcaSettings, results: dict[int, OrcaResult | None]) -> int | None:
    """Reasoning tokens the engine generated over all choices (the plugin counts them as it
    segments); None when orca did not run or a result is missing."""
    if not settings.enabled or not results or any(r is None for r in results.values()):
        return None
    return sum(reasoning_spent(r) for r in results.values() if r is not None)
