"""The deployed procedure: normalise -> pool per step -> score -> smooth -> decide -> update.

`ProbeBank` holds the state of many concurrent requests (one row each) and is the only code that
runs the decision: the server calls `step` once per engine step for the rows whose reasoning step
just completed, and calibration replays recorded trajectories through the very same `step`, so
the threshold chosen offline is applied to exactly the scores the server computes.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from orca_method.normalizations import Normalization
from orca_method.probe import Fast, Probe
from orca_method.shift_gate import ShiftGate
from orca_method.thresholds import GIVE_UP_NEVER, NEVER


def normalize_tokens(h: Tensor, mode: Normalization) -> Tensor:
    """Per-token normalisation applied before the step mean (docs/METHOD.md section 1)."""
    if mode == Normalization.TOKEN_L2:
        return torch.nn.functional.normalize(h.float(), dim=-1)
    return h.float()


def finish_step(total: Tensor, count: Tensor, mode: Normalization) -> Tensor:
    """Step embedding phi_t from the running sum of (normalised) token states and the count."""
    phi = total / count.clamp(min=1).to(total.dtype).unsqueeze(-1)
    if mode == Normalization.STEP_L2:
        phi = torch.nn.functional.normalize(phi, dim=-1)
    return phi


@dataclass
class StepResult:
    raw: Tensor  # s_t per row
    smoothed: Tensor  # m_t per row
    stop: Tensor  # bool per row: m_t >= lambda
    steps: Tensor  # steps scored so far per row, this one included
    give_up_score: Tensor | None = None  # g_t per row (smoothed), when the bank has a give-up probe
    give_up: Tensor | None = None  # bool per row: g_t <= mu and not stopping (the stop wins a tie)
    # the shift gate, when the bank has one and the call passed a GateStep: the nonconformity
    # score of each deciding row (GateStep.decide, [k]), whether the gate flagged it (the stop
    # side's level) and whether it bars its give-up (the give-up side's; every flagged row too)
    gate_score: Tensor | None = None
    gate_flag: Tensor | None = None
    gate_barred: Tensor | None = None


@dataclass
class GateStep:
    """Which rows of one `ProbeBank.step` call the shift gate works on, known to the caller (it
    counts each request's scored steps): `add`, positions (in the call's rows) of steps among a
    request's first `gate.steps`, whose embeddings the gate sums; `decide`, positions at the
    gate's step, scored now against their thresholds: `thr`, the stop side's (above it: flagged),
    and `thr_give_up`, the give-up side's (above it: never gives up; <= thr, its level being the
    higher one: `ShiftGate.thresholds`) ([k] each; all on the bank's device). A row before its
    gate step is held by the caller (threshold never, no give-up). The gate's matrix work is
    thus [k, d] x [d, rank] once per request, not per row and step."""

    add: Tensor
    decide: Tensor
    thr: Tensor
    thr_give_up: Tensor


class ProbeBank:
    """Batched per-request probe state, one row per request slot (rows 0..capacity-1, all fresh
    at the start; `reset` makes a row fresh again for its next request).

    `give_up`: the give-up probe and its smoothing window (docs/METHOD.md section 9), run on the
    same step embeddings in a bank of its own, so that each step also decides whether to give up.

    `gate`: the shift gate (orca_method/shift_gate.py) and the threshold a flagged row runs with
    from its gate step on (`gate_lam`: NEVER = full reasoning); a flagged row never gives up, nor
    does one the gate bars at the give-up side's level (`GateStep.thr_give_up`).
    """

    def __init__(self, probe: Probe, window: int = 10, capacity: int = 64,
                 device: str | torch.device = "cpu",
                 give_up: tuple[Probe, int] | None = None,
                 gate: ShiftGate | None = None, gate_lam: float = NEVER) -> None:
        if window < 1:
            raise ValueError(f"smoothing window must be >= 1, got {window}")
        self.probe = probe.to(device).eval()
        self.window = window
        self.device = torch.device(device)
        with torch.no_grad():
            fast = self.probe.init_fast(capacity)
        self._fast: Fast = {k: v.to(self.device) for k, v in fast.items()}
        self._fast["hist"] = torch.zeros(capacity, window, device=self.device)  # [cap, W]
        self._fast["count"] = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self._buf: Fast = {k: torch.empty_like(self._fast[k]) for k in self.probe.fast_keys()}
        self._scratch = torch.empty(capacity, self.probe.spec.d_w, device=self.device)
        self.give_up = (None if give_up is None else
                        ProbeBank(give_up[0], window=give_up[1], capacity=capacity, device=device))
        self.gate, self.gate_lam = gate, float(gate_lam)
        if gate is not None:  # running sum of each row's first gate.steps step embeddings
            self._fast["gate_sum"] = torch.zeros(capacity, gate.mean.shape[0], device=self.device)

    @property
    def capacity(self) -> int:
        return self._fast["hist"].shape[0]

    def reset(self, row: int) -> None:
        """Fast weights = slow weights, empty smoothing window."""
        with torch.no_grad():
            init = self.probe.init_fast(1)
        for k, v in init.items():
            self._fast[k][row] = v[0]
        self._fast["hist"][row] = 0
        # zero_, not `= 0`: a number written into one element is copied from the host (on CUDA a
        # pageable copy, which waits for the device), where zero_ runs on the device
        self._fast["count"][row].zero_()
        if self.gate is not None:
            self._fast["gate_sum"][row] = 0
        if self.give_up is not None:
            self.give_up.reset(row)

    def snapshot(self, row: int) -> dict[str, Tensor]:
        """A copy of one row's state, e.g. to survive a preemption that frees the row."""
        snap = {k: v[row].clone() for k, v in self._fast.items()}
        if self.give_up is not None:
            snap |= {f"give_up.{k}": v for k, v in self.give_up.snapshot(row).items()}
        return snap

    def restore(self, row: int, snap: dict[str, Tensor]) -> None:
        for k, v in snap.items():
            if k.startswith("give_up."):
                self.give_up._fast[k.removeprefix("give_up.")][row] = v
            else:
                self._fast[k][row] = v

    # -- the procedure -----------------------------------------------------------------
    @torch.no_grad()
    def step(self, rows: Sequence[int], phi: Tensor, lam: Tensor,
             rows_dev: Tensor | None = None, mu: Tensor | None = None,
             gate: GateStep | None = None) -> StepResult:
        """Score, smooth, decide and (for rows that do not stop) update: one reasoning step.

        `mu`: [m] give-up thresholds (GIVE_UP_NEVER = -inf: this row never gives up), for a
        bank with a give-up probe; its smoothed score is computed for every row either way.
        `gate`: the rows the shift gate works on (`GateStep`), for a bank with a gate; the rows
        it flags at their gate step run with `gate_lam` at this step already, and those it bars
        (flagged ones included) do not give up at it (the caller then keeps them so): the one
        place the gate's decisions are applied.

        rows: [m] distinct row ids on the host (a list, or a CPU tensor), phi: [m, d] step
        embeddings, lam: [m] thresholds (inf = never); `rows_dev`: the same rows already on the
        device (the server stages them with its other per-step indexes in one copy; without it
        they are copied here). Works in place on the bank (a view when the rows are contiguous,
        else one gather into a reused buffer): fresh [m, d] temporaries cost page faults that
        dominate at d = 5,120. Nothing here waits for the device; the caller copies the result
        once.
        """
        phi = phi.to(self.device, torch.float32)
        host = rows.tolist() if isinstance(rows, Tensor) else list(rows)
        m = len(host)
        r0 = host[0]
        contiguous = host == list(range(r0, r0 + m))  # host bookkeeping: no sync
        if rows_dev is None:
            rows_dev = torch.tensor(host, dtype=torch.long).to(self.device, non_blocking=True)
        rows = rows_dev
        keys = self.probe.fast_keys()
        if contiguous:
            fast = {k: self._fast[k][r0:r0 + m] for k in keys}
        else:
            fast = {k: torch.index_select(self._fast[k], 0, rows, out=self._buf[k][:m]) for k in keys}
        logit = self.probe.logit(fast, self.probe.query(phi), self._scratch)
        raw = torch.sigmoid(logit)
        hist, count = self._fast["hist"], self._fast["count"]
        n = count.index_select(0, rows)
        hist[rows, n % self.window] = raw
        n = n + 1
        smoothed = hist.index_select(0, rows).sum(1) / n.clamp(max=self.window)
        count[rows] = n
        lam = lam.to(self.device)
        score = flag = barred = None
        if self.gate is not None and gate is not None:
            score, flag, barred = self._gate(rows, phi, gate)
            lam = self.gated(lam, gate.decide, flag, self.gate_lam)
            if mu is not None:
                mu = self.gated(mu.to(self.device), gate.decide, barred, GIVE_UP_NEVER)
        stop = smoothed >= lam
        out = StepResult(raw=raw, smoothed=smoothed, stop=stop, steps=n, gate_score=score,
                         gate_flag=flag, gate_barred=barred)
        # a stopping row is not updated (its request ends here)
        self.probe.update_(fast, phi, logit, frozen=stop)
        if not contiguous:
            for k in keys:
                self._fast[k].index_copy_(0, rows, fast[k])
        if self.give_up is not None:
            never = torch.full_like(smoothed, NEVER)
            g = self.give_up.step(host, phi, never, rows_dev=rows).smoothed
            mu = torch.full_like(g, GIVE_UP_NEVER) if mu is None else mu.to(self.device)
            out.give_up_score, out.give_up = g, (g <= mu) & ~stop
        return out

    @staticmethod
    def gated(v: Tensor, decide: Tensor, flag: Tensor, safe: float) -> Tensor:
        """`v` ([m] thresholds) with `safe` at the deciding rows the gate flagged (the safe
        action's lambda, `gate_lam`; or GIVE_UP_NEVER for the give-up threshold)."""
        now = v.index_select(0, decide)  # [k]
        return v.index_put((decide,), torch.where(flag, torch.full_like(now, safe), now))

    def _gate(self, rows: Tensor, phi: Tensor, g: GateStep) -> tuple[Tensor, Tensor, Tensor]:
        """(score, flagged, barred from giving up) of the deciding rows ([k] each), after the
        gathering rows added their step embeddings to their running sums. Every flagged row is
        barred, whatever thresholds the caller passed."""
        gsum = self._fast["gate_sum"]
        gsum.index_put_((rows.index_select(0, g.add),), phi.index_select(0, g.add),
                        accumulate=True)
        decide = rows.index_select(0, g.decide)
        score = self.gate.score(gsum.index_select(0, decide) / self.gate.steps)  # [k]
        flag = score > g.thr
        return score, flag, flag | (score > g.thr_give_up)


def as_tensor(arr) -> Tensor:
    """A tensor view of an array, memory maps included (read-only ones are only ever read here;
    `torch.tensor(fp16_array, dtype=float32)` is a slow element-wise path, this is not)."""
    if isinstance(arr, Tensor):
        return arr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(arr))


@torch.no_grad()
def replay(probe: Probe, trajectories: list, window: int,
           batch: int = 64) -> list[tuple[Tensor, Tensor]]:
    """Run the deployed procedure over recorded step embeddings ([T_i, d] arrays), never stopping.

    Returns (raw scores, smoothed scores) per trajectory. With no stop, the scores up to any stop
    step are exactly those the server would have produced, so LTT can evaluate every threshold.
    """
    out: list[tuple[Tensor, Tensor]] = []
    for start in range(0, len(trajectories), batch):
        chunk = [as_tensor(t).to(torch.float32) for t in trajectories[start:start + batch]]
        lengths = torch.tensor([len(t) for t in chunk])
        phi = torch.nn.utils.rnn.pad_sequence(chunk, batch_first=True)
        bank = ProbeBank(probe, window=window, capacity=len(chunk))
        rows = torch.arange(len(chunk))
        raw = torch.zeros(len(chunk), int(lengths.max()))
        smooth = torch.zeros_like(raw)
        never = torch.full((len(chunk),), NEVER)
        for t in range(raw.shape[1]):
            live = (lengths > t).nonzero().squeeze(1)
            res = bank.step(rows[live], phi[live, t], never[live])
            raw[live, t] = res.raw
            smooth[live, t] = res.smoothed
        out += [(raw[i, :n], smooth[i, :n]) for i, n in enumerate(lengths.tolist())]
    return out
