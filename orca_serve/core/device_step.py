"""The device half of an engine step: run a `StepPlan` on preallocated memory, wait for nothing.

One staging copy brings the plan's index lists to the device; then, on the device: the step's
token rows (normalised) are added to their slots' section sums, rows whose token id is not known
yet are parked, completed steps are pooled (`finish_step`) and scored by each deployment's probe
bank, a probe stop or give-up forces its plan's tokens of this step into the request's logits
rows (decided on the device: the host does not know the flag yet), tokens forced by plans the
host knows are written, and the scores go back in one non_blocking readback, read on the next
step.

Forcing (`DeviceStep._force`, the one place) never builds a [rows, vocab] tensor: the logits
rows are changed in place, each to one token or to its own argmax (a greedy answer row):
`index_fill_` for host-known plans; for device-decided stops an -inf or 0 per row added across
the row, then the forced token's entry set back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from orca_method.procedure import GateStep, Normalization, finish_step, normalize_tokens
from orca_method.steps import CLOSE, MERGE, STEP, STEP_PREV
from orca_serve.core.deployment import Deployment
from orca_serve.core.plan import IDX, StepPlan
from orca_serve.core.pooling import Fence, Readback, SlotPool, Staged, Staging
from orca_serve.core.stopping import FREE, GREEDY


class DeviceStep:
    """The core's device memory (slots, staging, readback, fence) and the step that runs on it."""

    def __init__(self, capacity: int, hidden_size: int, device: torch.device, pin: bool,
                 normalization: Normalization) -> None:
        self.pool = SlotPool(capacity, hidden_size, device)
        self.fence = Fence(device)
        # room for `capacity` values per staged vector, shared; the forcing vectors (cand_*,
        # forced_*) hold up to 1 + k values per request under speculative decoding with k
        # drafts: a step that needs more grows it (`Staging._grow`)
        self.staging = Staging(len(IDX) * capacity, device, pin, self.fence)
        self.readback = Readback(capacity, device, pin, self.fence)
        self.normalization = normalization

    def run(self, p: StepPlan, hidden: Tensor | None, logits: Tensor) -> None:
        """hidden: [rows, d] captured rows, logits: [rows, vocab] (changed in place)."""
        try:  # marked even when the staging fails: its buffer counts this step as its user
            v = self.staging.upload(p.staged())
            self._pool_tokens(p, v, hidden, logits.shape[0])
            if p.op_slots:
                self._finish_steps(p, v, logits)
            if p.forced_rows:  # the plans the host knows
                self._force(logits, v.long(IDX["forced_rows"]), v.long(IDX["forced_ids"]),
                            p.forced_greedy)
        finally:
            self.fence.mark()

    @staticmethod
    def _force(logits: Tensor, rows: Tensor, ids: Tensor, greedy: bool,
               flag: Tensor | None = None) -> None:
        """Force each of `rows` [f] to its id in `ids` [f]: the row -inf but that token, which
        the sampler then takes at any temperature; GREEDY: the row's argmax (an answer row;
        `greedy`: the host staged one). `flag` [f]: force only the flagged rows, leave the
        others as they are (a stop decided on the device; an unflagged id may be FREE)."""
        if greedy:
            # argmax over every row, then picked: no [f, vocab] copy
            ids = torch.where(ids == GREEDY, logits.argmax(dim=-1).index_select(0, rows), ids)
        if flag is None:
            logits.index_fill_(0, rows, float("-inf"))
            logits.index_put_((rows, ids), logits.new_zeros(()))
            return
        ids = ids.clamp(min=0)  # a FREE id (unflagged): any entry, its value is written back
        keep = logits[rows, ids]  # [f]
        # -inf across a flagged row, 0 across the others: no [f, vocab] tensor is made
        bias = torch.zeros_like(keep).masked_fill_(flag, float("-inf"))  # [f]
        # (index_put_: index_add_ entered an OpenMP region that spun on a busy CPU)
        logits.index_put_((rows,), bias[:, None].expand(-1, logits.shape[1]), accumulate=True)
        logits.index_put_((rows, ids), keep.masked_fill_(flag, 0.0))

    def _pool_tokens(self, p: StepPlan, v: Staged, hidden: Tensor | None, n_rows: int) -> None:
        """S[slot] += normalised row, for this step's rows and the parked ones; park rows."""
        if not (p.pool_rows or p.lag_slots or p.park_rows):
            return
        if hidden is None or hidden.shape[0] != n_rows:
            got = None if hidden is None else hidden.shape[0]
            raise RuntimeError(f"captured {got} hidden rows for {n_rows} logits rows")
        pool = self.pool
        if p.pool_rows or p.lag_slots:
            parts, slots = [], []
            if p.pool_rows:
                parts.append(hidden.index_select(0, v.long(IDX["pool_rows"])))
                slots.append(v.long(IDX["pool_slots"]))
            if p.lag_slots:
                slots.append(v.long(IDX["lag_slots"]))
                parts.append(pool.lag.index_select(0, slots[-1]))
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)  # [k, d]
            h = normalize_tokens(rows, self.normalization).to(pool.S.dtype)
            # slots are distinct within a step; index_put_ stays serial on CPU
            pool.S.index_put_((slots[0] if len(slots) == 1 else torch.cat(slots),), h,
                              accumulate=True)
        if p.park_rows:
            pool.lag.index_copy_(0, v.long(IDX["park_slots"]),
                                 hidden.index_select(0, v.long(IDX["park_rows"])).float())

    def _finish_steps(self, p: StepPlan, v: Staged, logits: Tensor) -> None:
        """Apply the ops to A/S, finish the emitted steps, score them, force stops."""
        pool = self.pool
        slots = v.long(IDX["op_slots"])
        if not p.keywords:  # every op is STEP or CLOSE and A stays zero: the step is S
            num = pool.S.index_select(0, v.long(IDX["emit_slots"])) if p.emit_ops else None
        else:
            # phi numerator = cA*A + cS*S ; new A = aA*A + aS*S ; new S = 0
            kinds = v.long(IDX["op_kinds"])
            c_s = ((kinds == STEP) | (kinds == CLOSE)).to(pool.S.dtype)  # [k]
            a_a = (kinds == MERGE).to(pool.S.dtype)
            a_s = ((kinds == MERGE) | (kinds == STEP_PREV)).to(pool.S.dtype)
            A = pool.A.index_select(0, slots)  # [k, d]
            S = pool.S.index_select(0, slots)
            num = (A + S * c_s[:, None]).index_select(0, v.long(IDX["emit_ops"]))  # [e, d]
            pool.A.index_copy_(0, slots, A * a_a[:, None] + S * a_s[:, None])
        pool.S.index_fill_(0, slots, 0.0)
        if num is None:
            return
        phi = finish_step(num, v.long(IDX["emit_counts"]), self.normalization)  # [e, d]
        for req, j, size in p.record:
            req.step_embs.append(phi[j])
            req.step_counts.append(size)
        if p.scored:
            self._score(p, v, phi, logits)

    @staticmethod
    def _gate_step(v: Staged, dep: Deployment, ranges: tuple[int, int, int, int]
                   ) -> GateStep | None:
        """One deployment group's `GateStep` (None: its bank has no gate)."""
        if dep.bank.gate is None:
            return None
        a0, a1, d0, d1 = ranges
        return GateStep(v.long(IDX["gate_add"])[a0:a1], v.long(IDX["gate_decide"])[d0:d1],
                        v.exact(IDX["gate_thr"])[d0:d1], v.exact(IDX["gate_thr_give_up"])[d0:d1])

    def _score(self, p: StepPlan, v: Staged, phi: Tensor, logits: Tensor) -> None:
        """Each deployment's scored steps through its bank; a stop or a give-up forces its first
        token."""
        in_order = len(p.groups) == 1 and len(p.scored) == phi.shape[0]  # scored = emitted
        phi_s = phi if in_order else phi.index_select(0, v.long(IDX["scored"]))  # [m, d]
        lam, slots = v.exact(IDX["bank_lam"]), v.long(IDX["scored_slots"])
        hit_lam = v.exact(IDX["hit_lam"])
        mu = v.exact(IDX["bank_mu"])
        gates = [self._gate_step(v, dep, r) for (dep, _, _), r in zip(p.groups, p.gate_ranges)]
        res = [dep.bank.step(p.scored_slots[a:b], phi_s[a:b], lam[a:b], rows_dev=slots[a:b],
                             mu=mu[a:b], gate=g)
               for (dep, a, b), g in zip(p.groups, gates)]
        hit_thr = []
        for (dep, a, b), g, r in zip(p.groups, gates, res):
            # a deployment without a give-up probe: score 1 (it would not give up), flag False
            if r.give_up is None:
                r.give_up_score, r.give_up = torch.ones_like(r.smoothed), torch.zeros_like(r.stop)
            # the gate's [k] decisions as [m] rows (score 0, not flagged nor barred where it did
            # not decide); the would-stop thresholds as the gate leaves them, by the bank's rule
            score, flag, h = torch.zeros_like(r.smoothed), torch.zeros_like(r.stop), hit_lam[a:b]
            barred = flag
            if r.gate_flag is not None:
                score = score.index_put((g.decide,), r.gate_score)
                barred = flag.index_put((g.decide,), r.gate_barred)
                flag = flag.index_put((g.decide,), r.gate_flag)
                h = dep.bank.gated(h, g.decide, r.gate_flag, dep.bank.gate_lam)
            r.gate_score, r.gate_flag, r.gate_barred = score, flag, barred
            hit_thr.append(h)
        hit_thr = hit_thr[0] if len(hit_thr) == 1 else torch.cat(hit_thr)
        # [m] each: slices of device tensors and their concatenation wait for nothing
        keys = ("smoothed", "stop", "steps", "give_up_score", "give_up", "gate_score", "gate_flag",
                "gate_barred")
        smoothed, stop, steps, g, gave, gate_score, flagged, barred = (
            tuple(getattr(res[0], k) for k in keys) if len(res) == 1
            else tuple(torch.cat([getattr(r, k) for r in res]) for k in keys))
        if p.cand_pos:
            # the plan of the flag set (stop and give-up exclude each other: ProbeBank.step),
            # on each of the request's rows where that plan forces a token
            pos = v.long(IDX["cand_pos"])
            gave_c = gave.index_select(0, pos)  # [c]
            ids = torch.where(gave_c, v.long(IDX["cand_give_up_ids"]), v.long(IDX["cand_ids"]))
            flag = (gave_c | stop.index_select(0, pos)) & (ids != FREE)  # [c]
            self._force(logits, v.long(IDX["cand_rows"]), ids, p.cand_greedy, flag)
        hit = smoothed >= hit_thr
        self.readback.start(torch.stack([smoothed.float(), hit.float(), steps.float(),
                                         g.float(), gave.float(), gate_score.float(),
                                         flagged.float(), barred.float()]))
