"""The host half of an engine step: per-request bookkeeping in one pass, one typed `StepPlan` out.

For each tracked row (an `Entry`) the planner checks the output length, feeds the request's new
token to its `Segmenter` (or parks the row while the token id is unknown: async scheduling),
applies the budget guard and looks up the tokens its stop plan forces now (for a step it
scores: those a stop or give-up the device decides would force). What the device has to do
follows as flat index lists (`StepPlan`), staged to the device in one copy; nothing here
touches a tensor. `apply_readback` is the other end: the previous step's scores and stop flags
reach the requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orca_method.steps import CLOSE, MERGE, NONE, STEP_PREV
from orca_method.thresholds import GIVE_UP_NEVER, NEVER
from orca_serve.core import gate_alarm
from orca_serve.core.deployment import Deployment
from orca_serve.settings.contract import StopReason
from orca_serve.core.registry import Entry, Request
from orca_serve.core.speculation import UNKNOWN, sampled_rows
from orca_serve.core.stopping import (
    FREE,
    GREEDY,
    forced_id,
    gives_up_own_plan,
    request_plan,
    stop_request,
)


@dataclass(slots=True)
class StepPlan:
    """What the device does in one step. Lists named in `STAGED` go to the device in one copy
    (`Staging.upload`, in that order); the rest stays on the host."""

    pool_rows: list[int] = field(default_factory=list)  # hidden rows pooled into S ...
    pool_slots: list[int] = field(default_factory=list)  # ... of these slots
    lag_slots: list[int] = field(default_factory=list)  # parked rows pooled into S (same slot)
    park_rows: list[int] = field(default_factory=list)  # hidden rows parked in lag ...
    park_slots: list[int] = field(default_factory=list)  # ... of these slots
    op_slots: list[int] = field(default_factory=list)  # a section ended (any op)
    op_kinds: list[int] = field(default_factory=list)
    emit_ops: list[int] = field(default_factory=list)  # ops that end a step (not MERGE) ...
    emit_slots: list[int] = field(default_factory=list)  # ... their slots
    emit_counts: list[int] = field(default_factory=list)  # ... and token counts
    scored: list[int] = field(default_factory=list)  # emitted steps scored, by deployment
    bank_lam: list[float] = field(default_factory=list)  # the bank's threshold (NEVER: none)
    hit_lam: list[float] = field(default_factory=list)  # the would-stop threshold
    bank_mu: list[float] = field(default_factory=list)  # the give-up threshold (-inf: none)
    # the shift gate, by position in the scored steps' deployment group (a GateStep per group):
    gate_add: list[int] = field(default_factory=list)  # steps among a request's first gate.steps
    gate_decide: list[int] = field(default_factory=list)  # steps at the gate's step ...
    gate_thr: list[float] = field(default_factory=list)  # ... their stop side's thresholds
    gate_thr_give_up: list[float] = field(default_factory=list)  # ... and give-up side's
    scored_slots: list[int] = field(default_factory=list)
    # forced ids: a token, GREEDY (the row's argmax: a greedy answer row) or FREE (none)
    cand_pos: list[int] = field(default_factory=list)  # scored steps whose end forces now:
    cand_rows: list[int] = field(default_factory=list)  # their logits rows (1 + drafts each)
    cand_ids: list[int] = field(default_factory=list)  # the id a stop forces there
    cand_give_up_ids: list[int] = field(default_factory=list)  # the id a give-up forces there
    forced_rows: list[int] = field(default_factory=list)  # rows forced by plans known now
    forced_ids: list[int] = field(default_factory=list)  # their ids (no FREE)
    # host only
    record: list[tuple[Request, int, int]] = field(default_factory=list)  # (req, emitted, size)
    groups: list[tuple[Deployment, int, int]] = field(default_factory=list)  # scored ranges
    # per group: its ranges in gate_add and in gate_decide / gate_thr
    gate_ranges: list[tuple[int, int, int, int]] = field(default_factory=list)
    # (req, n, guard-stopped, logits rows a stop forces on the device: 1 + draft rows)
    pending: list[tuple[Request, int, bool, int]] = field(default_factory=list)
    keywords: bool = False  # an op of a keyword table: A is in use (else it stays zero)
    cand_greedy: bool = False  # a GREEDY among the cand_*ids (the device takes argmaxes)
    forced_greedy: bool = False  # a GREEDY among forced_ids

    def staged(self) -> list[list]:
        return [getattr(self, name) for name in STAGED]


STAGED = ("pool_rows", "pool_slots", "lag_slots", "park_rows", "park_slots", "op_slots",
          "op_kinds", "emit_ops", "emit_slots", "emit_counts", "scored", "bank_lam", "hit_lam",
          "bank_mu", "scored_slots", "cand_pos", "cand_rows", "cand_ids", "cand_give_up_ids",
          "forced_rows", "forced_ids", "gate_add", "gate_decide", "gate_thr",
          "gate_thr_give_up")
IDX = {name: i for i, name in enumerate(STAGED)}


def plan_step(entries: list[Entry], n_rows: int, stats: dict[str, Any]) -> StepPlan:
    """One pass over the step's rows (see module docstring)."""
    p = StepPlan()
    # scored steps: (deployment, request, emitted position, logits row, n, guard-stopped)
    scored: list[tuple[Deployment, Request, int, int, int, bool]] = []
    for req, row, n, prev_id, last_id in entries:
        slot = req.slot
        if row >= n_rows or n == 0 or slot is None:
            continue
        op = NONE
        if n > req.n_seen:
            if n != req.n_seen + 1:
                req.fail(f"output grew from {req.n_seen} to {n} tokens between two steps "
                         "(speculative decoding?): hidden states missing")
                req.n_seen = n
                continue
            req.n_seen = n
            if last_id >= 0 and req.plan and req.plan.get(n - 1, last_id) != last_id:
                req.notes.append(f"forced token at {n - 1} was overridden ({last_id})")
            if req.active:
                tid, src = last_id, row
                if req.lag is not None or last_id < 0:  # park this row, feed the parked one
                    if req.lag is not None and prev_id < 0:
                        req.fail("two token ids in a row still unknown")
                        continue
                    p.park_rows.append(row)
                    p.park_slots.append(slot)
                    if req.lag is None:
                        tid = UNKNOWN
                        stats["lagged_tokens"] += 1
                    else:
                        tid, src = prev_id, None
                    req.lag = n - 1
                if tid >= 0:
                    op = _feed(p, req, tid, src)
        else:  # a row at an unchanged length: a recompute (prefill) chunk
            stats["recompute_chunks"] += 1
            if req.lag is not None and req.active and last_id >= 0:  # catch up
                req.lag = None
                op = _feed(p, req, last_id, None)
        scores_now = op not in (NONE, MERGE, CLOSE)
        guard = (req.guard_pos is not None and n >= req.guard_pos and not req.stopped
                 and req.active and req.seg.reasoning)
        if guard:
            stop_request(req, n, StopReason.BUDGET)
        if scores_now and req.enabled and (not req.stopped or guard):
            scored.append((req.dep, req, len(p.emit_ops) - 1, row, n, guard))
        if req.plan or req.greedy:
            for q, r in sampled_rows(req, row, n):
                t = forced_id(req.plan, req.greedy, q)
                if t == FREE:
                    continue
                p.forced_rows.append(r)
                p.forced_ids.append(t)
                p.forced_greedy |= t == GREEDY
                if t != GREEDY:
                    req.forced[q] = t
    if scored:
        _plan_scoring(p, scored)
    return p


def _feed(p: StepPlan, req: Request, tid: int, src: int | None) -> int:
    """Segment one token; `src`: its hidden row in this step (None: parked in pool.lag)."""
    seg = req.seg
    a_before, s_before = seg.a_count, seg.s_count
    counted, op = seg.feed(tid)
    if counted:
        if src is None:
            p.lag_slots.append(req.slot)
        else:
            p.pool_rows.append(src)
            p.pool_slots.append(req.slot)
    if op == NONE:
        return op
    p.op_slots.append(req.slot)
    p.op_kinds.append(op)
    if seg.table.keyword_re is not None:
        p.keywords = True
    if op == MERGE:
        return op
    size = a_before if op == STEP_PREV else a_before + s_before + counted
    p.emit_ops.append(len(p.op_slots) - 1)
    p.emit_slots.append(req.slot)
    p.emit_counts.append(size)
    if req.record:
        p.record.append((req, len(p.emit_ops) - 1, size))
    return op


def _plan_scoring(p: StepPlan, scored: list[tuple[Deployment, Request, int, int, int, bool]]
                  ) -> None:
    """Scored steps grouped by deployment (each a contiguous range scored by its own bank), their
    thresholds, and the rows a stop would force a token into right now."""
    if any(s[0] is not scored[0][0] for s in scored):
        order: dict[int, int] = {}
        for s in scored:
            order.setdefault(id(s[0]), len(order))
        scored.sort(key=lambda s: order[id(s[0])])
    start = 0
    for j, (dep, req, e, row, n, guard) in enumerate(scored):
        if j and dep is not scored[j - 1][0]:
            _close_group(p, scored[j - 1][0], start, j)
            start = j
        shadow = not req.policy.rule.acts
        # a request the shift gate flagged runs with its deployment's safe threshold; one whose
        # gate has not decided yet neither stops nor gives up
        held = _plan_gate(p, req, j - start)
        alarm = gate_alarm.serves(req)  # the gate alarm serves it as a flagged one
        lam = (NEVER if held else dep.bank.gate_lam if req.shift_flagged
               else max(req.lam, dep.bank.gate_lam) if alarm else req.lam)
        p.scored.append(e)
        p.scored_slots.append(req.slot)
        p.bank_lam.append(NEVER if shadow else lam)
        p.hit_lam.append(NEVER if shadow and req.would_stop_step is not None else lam)
        # shadow (audited) requests run to the end: they never give up; nor do flagged ones,
        # nor those the gate barred at the give-up side's level (flagged ones are barred too)
        mu = req.settings.give_up_mu
        p.bank_mu.append(GIVE_UP_NEVER if shadow or mu is None or req.shift_barred or held
                         or alarm else mu)
        p.pending.append((req, n, guard, 1 + len(req.draft_rows)))
        if not guard and not shadow:
            _plan_candidates(p, j, req, row, n, p.bank_mu[-1] != GIVE_UP_NEVER)
    _close_group(p, scored[-1][0], start, len(scored))


def _plan_candidates(p: StepPlan, j: int, req: Request, row: int, n: int,
                     can_give_up: bool) -> None:
    """What a stop or a give-up the device decides at scored step j forces in this step: the
    host learns of it after the step, so each plan is staged for every row of the request (row
    0 and its draft rows: core/speculation.py), its forced text and the argmax of its answer;
    the device forces the plan of the flag it sets. The give-up's plan is made only where it
    can differ (`gives_up_own_plan`) and the request can give up in this step."""
    stop = request_plan(req, n, StopReason.PROBE)
    give_up = (request_plan(req, n, StopReason.GIVE_UP)
               if can_give_up and gives_up_own_plan(req) else stop)
    for q, r in sampled_rows(req, row, n):
        stop_id = forced_id(stop.forced, stop.greedy, q)
        give_up_id = forced_id(give_up.forced, give_up.greedy, q)
        if stop_id == give_up_id == FREE:
            continue
        p.cand_pos.append(j)
        p.cand_rows.append(r)
        p.cand_ids.append(stop_id)
        p.cand_give_up_ids.append(give_up_id)
        p.cand_greedy |= GREEDY in (stop_id, give_up_id)


def _plan_gate(p: StepPlan, req: Request, pos: int) -> bool:
    """The shift gate's part of one scored step at `pos` in its group: counts the request's
    gated steps; returns whether the gate still holds it (its step is before the gate's)."""
    if not req.gated or req.gate_seen >= req.dep.gate.steps:
        return False
    req.gate_seen += 1
    p.gate_add.append(pos)
    if req.gate_seen < req.dep.gate.steps:
        return True
    p.gate_decide.append(pos)
    p.gate_thr.append(req.shift_thr)
    p.gate_thr_give_up.append(req.shift_thr_give_up)
    return False


def _close_group(p: StepPlan, dep: Deployment, start: int, end: int) -> None:
    """Scored steps [start, end) are one deployment's; so are the gate entries since the last
    group's."""
    add0, dec0 = (p.gate_ranges[-1][1], p.gate_ranges[-1][3]) if p.gate_ranges else (0, 0)
    p.groups.append((dep, start, end))
    p.gate_ranges.append((add0, len(p.gate_add), dec0, len(p.gate_decide)))


def apply_readback(pending: list[tuple[Request, int, bool, int]], host: list[list[float]],
                   stats: dict[str, Any]) -> None:
    """The previous step's decisions reach the host: scores, would-stop, stop and give-up steps,
    and the rest of each stop's forced text (its first token was forced on the device; a
    give-up forces the same first token as a stop: core/stopping.py)."""
    sm, hit, steps, give_up, gave, gate_score, flagged, barred = host
    stats["steps_scored"] += len(pending)
    for i, (req, pos, guard_stopped, rows) in enumerate(pending):
        req.scores.append(sm[i])
        req.steps_scored = int(steps[i])
        if req.dep.bank.give_up is not None:
            req.last_give_up = give_up[i]
        if req.gated and req.steps_scored == req.dep.gate.steps:
            req.shift_pvalue = req.dep.gate.pvalue(gate_score[i])
            req.shift_flagged = flagged[i] >= 0.5
            req.shift_barred = barred[i] >= 0.5
            gate_alarm.feed(req, req.shift_pvalue, stats)
        if gave[i] >= 0.5:
            if guard_stopped:
                continue  # the budget guard closed it at this step already: its plan stands
            req.give_up_step = req.steps_scored
            _end(req, pos, rows, StopReason.GIVE_UP)
            continue
        if hit[i] < 0.5:
            continue
        if req.would_stop_step is None:
            req.would_stop_step = req.steps_scored
        if not req.policy.rule.acts:
            continue
        req.stop_step = req.steps_scored
        if guard_stopped:  # a guard stop at the same step already planned the same
            req.stop_reason = StopReason.PROBE
            continue
        _end(req, pos, rows, StopReason.PROBE)


def _end(req: Request, pos: int, rows: int, reason: StopReason) -> None:
    """A device-decided stop or give-up at `pos`: plan the rest, record what was forced."""
    stop_request(req, pos, reason)
    if pos >= req.decided_until:  # else nothing was forced: see core/speculation.py
        for q in range(pos, pos + rows):
            t = req.plan.get(q)
            if t is not None:
                req.forced[q] = t
