"""Learn-then-Test for the consensus margin t (docs/METHOD.md section 14), as for lambda*.

The loss of a group is 0/1: its answer is not maj@k of its samples run to their end. It needs no
reference answer, so the live audit can check it. Fixed-sequence testing over the grid of t from
1 (the remaining samples cannot change the vote) down to 0 rejects ``H_t: risk(t) > delta_vote``
while the p-value (orca_method/ltt.py's) is at most epsilon; t* is the last rejected. With the
confidence clause the hypotheses are pairs (t, c) along a path fixed in advance
(`orca_method.consensus.confident_path`), tested the same way: (t*, c*) is the last rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orca_method.consensus import NO_CAP, Group, default_grid, outcomes
from orca_method.ltt import DEFAULT_EPSILON, n_rejected, pvalue_fn
from orca_method.outcomes import PValue


@dataclass(frozen=True)
class ConsensusResult:
    """LTT's outcome for one delta_vote: t* (None: no t certified; the group then runs its
    samples to their end, whose vote is maj@k itself), with calibration facts at t* (at t = 1
    for an uncertified row: what stopping would have cost)."""

    delta_vote: float
    t: float | None
    risk: float
    pvalue: float
    token_savings: float  # 1 - tokens at t* / tokens with every sample to its ORCA stop
    n: int
    cap: float | None = None  # c*: the confidence clause's cap at t* (None: off, or no t*)


def calibrate_consensus(groups: Sequence[Group], deltas_vote: Sequence[float],
                        epsilon: float = DEFAULT_EPSILON, grid: np.ndarray | None = None,
                        pvalue: PValue = PValue.BINOMIAL,
                        caps: np.ndarray | None = None) -> list[ConsensusResult]:
    """t* per delta_vote by fixed-sequence testing over `grid` (from t = 1 down), as lambda*
    (orca_method/ltt.py): with probability >= 1 - epsilon over the calibration groups,
    P(answer != maj@k of the full samples) <= delta_vote for a fresh group. With `caps` (the
    confidence clause's c beside each t: `confident_path`) the hypotheses are the pairs, in
    that order, and the result carries c* too. The groups must be exchangeable with the served
    ones and must not have chosen the samples' lambda* (the per-sample stops are a fixed part of
    the procedure here), nor the path."""
    if not groups:
        raise ValueError("no calibration groups")
    pvalues = pvalue_fn(pvalue)
    if not 0.0 < epsilon < 1.0 or not all(0.0 < d < 1.0 for d in deltas_vote):
        raise ValueError("epsilon and every delta_vote must be in (0, 1)")
    grid = default_grid() if grid is None else np.asarray(grid, dtype=float)
    if grid.ndim != 1 or grid.size == 0 or grid[0] > 1 or grid[-1] < 0:
        raise ValueError("the grid must be margins in [0, 1]")
    if caps is None and np.any(np.diff(grid) >= 0):
        raise ValueError("the grid must be strictly decreasing margins")
    if caps is not None:
        caps = np.asarray(caps, dtype=float)
        on = np.where(caps == NO_CAP, -1.0, caps)  # "off" comes before every cap
        steps = np.stack([-np.diff(grid), np.diff(on)]) if caps.shape == grid.shape else None
        if steps is None or np.any(steps < 0) or np.any(steps.max(axis=0) <= 0):
            raise ValueError("a confidence path needs one cap per t, each step lowering t or "
                             "raising the cap (and neither going back)")
    n = len(groups)
    loss, tokens = outcomes(groups, grid, caps)
    full = sum(g.spent(np.inf) for g in groups)
    counts = loss.sum(axis=1, dtype=np.int64)  # [m]
    out = []
    for d in deltas_vote:
        p = pvalues(counts, n, d)
        last = n_rejected(p, epsilon) - 1
        j = max(last, 0)
        out.append(ConsensusResult(
            delta_vote=float(d), t=float(grid[last]) if last >= 0 else None,
            risk=float(counts[j] / n), pvalue=float(p[last]) if last >= 0 else 1.0,
            token_savings=float(1.0 - tokens[j].sum() / full) if full > 0 else 0.0, n=n,
            cap=None if last < 0 or caps is None or caps[last] == NO_CAP else float(caps[last])))
    return out
