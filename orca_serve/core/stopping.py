"""Stop planning: which tokens to force, at which output positions, once a request stops.

Policies (`orca_serve.settings.contract.Policy`, asked through their rules): `stop` forces EOS at
once; `answer` forces the end-of-thinking text, lets the model answer for `answer_budget` tokens,
then forces EOS; `shadow` never forces (it only reports where it would have stopped). The budget
guard closes the thinking of a policy-`answer` request early enough that an answer still fits in
`max_tokens`.

The answer after a stop is decoded greedily, whatever the request's sampling: the guarantee is
about the answer the calibration's probes forced, and they force it greedily. Sampled at the
request's temperature instead, a trace stopped mid-verification often writes another answer
(benchmarks/RESULTS-archive.md, "The answer after a stop").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orca_serve.settings.contract import MIN_ANSWER_TOKENS, Policy, StopReason
from orca_serve.core.speculation import plan_start

if TYPE_CHECKING:
    from orca_serve.core.registry import Request


GREEDY = -1  # a forced id: the row's argmax (a row of the greedy answer after a stop)
FREE = -2  # a forced id: the plan forces nothing there (the row is left as it is)


def forced_id(forced: Mapping[int, int], greedy: range, pos: int) -> int:
    """What a stop plan (its forced tokens by output position, its greedy answer's positions)
    forces at output position `pos`: a token, GREEDY or FREE."""
    return forced.get(pos, GREEDY if pos in greedy else FREE)


@dataclass(frozen=True, slots=True)
class StopPlan:
    """What a stop does to the output positions from the one sampled at the stop on."""

    forced: dict[int, int]  # output position -> forced token id
    greedy: range  # output positions of the answer: decoded greedily


def stop_plan(policy: Policy, pos: int, *, force_ids: list[int], eos: int | None,
              answer_budget: int, max_tokens: int | None, ignore_eos: bool) -> StopPlan:
    """The stop plan from `pos` (the token sampled now): forced token ids by output position,
    and the positions of the answer, between the forced text and the forced EOS."""
    limit = max_tokens if max_tokens is not None else math.inf
    forced: dict[int, int] = {}
    if not policy.rule.acts:
        return StopPlan(forced, range(0))
    if not policy.rule.answers:
        if eos is not None:
            forced[pos] = eos
        return StopPlan(forced, range(0))
    p = pos
    for t in force_ids:
        if p >= limit:
            break
        forced[p] = t
        p += 1
    eos_at = p + answer_budget
    if not ignore_eos and eos is not None and eos_at < limit:
        forced[eos_at] = eos
    return StopPlan(forced, range(p, int(min(eos_at, limit))))


def guard_position(policy: Policy, *, max_tokens: int | None, reserve: int | None,
                   force_len: int, answer_budget: int) -> int | None:
    """Output position at which a still-reasoning `answer` request is closed so that its answer
    fits (reserve = forced text + min(budget, 8) tokens unless given); None: no guard."""
    if not policy.rule.answers or max_tokens is None:
        return None
    if reserve is None:
        reserve = force_len + min(answer_budget, MIN_ANSWER_TOKENS)
    if reserve > 0 and max_tokens >= 2 * reserve:
        return max_tokens - reserve
    return None


def gives_up_own_plan(req: Request) -> bool:
    """A give-up of `req` forces another plan than its stop: under the operator's MESSAGE
    give-up policy, the end-of-thinking text, the message and EOS (without an end-of-thinking
    text, think tags off, it answers as a stop would)."""
    return req.give_up_ids is not None and req.policy.rule.answers and bool(req.dep.force_ids)


def request_plan(req: Request, pos: int, reason: StopReason) -> StopPlan:
    """`stop_plan` of a tracked request ending at output position `pos` for `reason`
    (`gives_up_own_plan`: what a give-up forces)."""
    if reason == StopReason.GIVE_UP and gives_up_own_plan(req):
        return stop_plan(Policy.ANSWER, pos, force_ids=req.dep.force_ids + req.give_up_ids,
                         eos=req.eos, answer_budget=0, max_tokens=req.max_tokens,
                         ignore_eos=req.ignore_eos)
    return stop_plan(req.policy, pos, force_ids=req.dep.force_ids, eos=req.eos,
                     answer_budget=req.answer_budget, max_tokens=req.max_tokens,
                     ignore_eos=req.ignore_eos)


def stop_request(req: Request, pos: int, reason: StopReason) -> None:
    """The request stops at `pos`: segmentation and scoring end, its forced text and its greedy
    answer are planned."""
    req.stopped = True
    req.stop_reason = reason
    req.active = False
    req.guard_pos = None
    plan = request_plan(req, plan_start(req, pos), reason)
    req.plan, req.greedy = plan.forced, plan.greedy
