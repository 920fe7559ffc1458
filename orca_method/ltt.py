"""Learn-then-Test choice of the stopping threshold lambda* (docs/METHOD.md section 5).

For each threshold ``lambda_j`` of a fixed grid, ordered from conservative (1.0) to
aggressive, ``H_j: risk(lambda_j) >= delta`` is tested with a valid p-value; fixed-sequence
testing rejects while ``p_j <= epsilon`` and stops at the first failure. lambda* is the LAST
REJECTED threshold, so with probability >= 1 - epsilon over the calibration draw
``risk(lambda*) <= delta`` (paper, appendix "Theoretical Guarantees"). Returning the first
failing threshold instead, as the research code does, is outside the guarantee.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.special import xlogy
from scipy.stats import binom

from orca_method.outcomes import PValue
from orca_method.stop_metrics import Ragged, check_problems, losses, stop_indices, summarize
from orca_method.thresholds import NEVER

DEFAULT_EPSILON = 0.05  # LTT's level: the guarantee holds with probability >= 1 - epsilon


def default_grid(m: int = 1001) -> np.ndarray:
    """``m`` evenly spaced thresholds from 1.0 (conservative) down to 0.0 (aggressive).

    The grid must not depend on the calibration scores: a grid built from them (e.g. their
    unique values) makes the hypotheses data-dependent and voids the LTT guarantee.
    """
    if m < 1:
        raise ValueError(f"grid size must be >= 1, got {m}")
    return np.linspace(1.0, 0.0, m)


def binomial_pvalues(loss_counts: np.ndarray, n: int, delta: float) -> np.ndarray:
    """Exact ``P(Binom(n, delta) <= k_j)`` for 0/1 losses, ``k_j`` the integer loss count.

    Integer counts avoid ``n * Rhat`` landing just below an integer through rounding.
    """
    return binom.cdf(np.asarray(loss_counts), n, delta)


def hoeffding_bentkus_pvalues(loss_sums: np.ndarray, n: int, delta: float) -> np.ndarray:
    """Hoeffding-Bentkus p-values (Bates et al. 2021), valid for any losses in [0, 1].

    ``min(exp(-n h1(min(Rhat, delta), delta)), e * P(Binom(n, delta) <= ceil(n Rhat)))``.
    """
    loss_sums = np.asarray(loss_sums, dtype=float)
    a = np.minimum(loss_sums / n, delta)
    h1 = xlogy(a, a / delta) + xlogy(1.0 - a, (1.0 - a) / (1.0 - delta))
    hoeffding = np.exp(-n * h1)
    bentkus = math.e * binom.cdf(np.ceil(loss_sums), n, delta)
    return np.minimum(hoeffding, bentkus)


PVALUES: dict[PValue, Callable[[np.ndarray, int, float], np.ndarray]] = {
    PValue.BINOMIAL: binomial_pvalues,
    PValue.HB: hoeffding_bentkus_pvalues,
}


def pvalue_fn(pvalue: str) -> Callable[[np.ndarray, int, float], np.ndarray]:
    """The p-value of the method named `pvalue` (a `PValue`'s word), checked once for every
    LTT of the package."""
    if pvalue not in PVALUES:
        raise ValueError(f"pvalue must be one of {', '.join(PValue)}, got {pvalue!r:.40}")
    return PVALUES[PValue(pvalue)]


def n_rejected(pvalues: np.ndarray, epsilon: float) -> int:
    """Rejections of fixed-sequence testing: the leading run of ``p_j <= epsilon``.

    Written as ``not (p <= epsilon)`` so that a NaN p-value stops the sequence.
    """
    failures = np.flatnonzero(~(np.asarray(pvalues) <= epsilon))
    return int(failures[0]) if failures.size else len(pvalues)


@dataclass(frozen=True)
class DeltaResult:
    """LTT outcome for one risk level, with calibration-set metrics at lambda*.

    ``lam`` is ``inf`` when no threshold is certified (never stop early); then ``pvalue`` is
    1.0: that fallback is not a tested hypothesis, and 1.0 ("no evidence") stays a plain
    float in JSON bundles, where NaN would not.
    """

    delta: float
    lam: float
    risk: float
    pvalue: float
    savings_per_problem: float  # the paper's definition (metrics.StopOutcome)
    savings_total_steps: float
    token_savings_total: float | None
    n: int


def _check_level(value: float, name: str) -> float:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value}")
    return float(value)


def _check_grid(grid: np.ndarray) -> np.ndarray:
    grid = np.asarray(grid, dtype=float)
    if grid.ndim != 1 or grid.size == 0 or not np.all(np.isfinite(grid)):
        raise ValueError("grid must be a non-empty 1-D array of finite thresholds")
    if np.any(np.diff(grid) >= 0):
        raise ValueError("grid must be strictly decreasing (conservative to aggressive)")
    return grid


def calibrate(
    scores: Ragged,
    labels: Ragged,
    deltas: Sequence[float],
    epsilon: float = DEFAULT_EPSILON,
    grid: np.ndarray | None = None,
    pvalue: PValue = PValue.BINOMIAL,
    step_tokens: Ragged | None = None,
) -> list[DeltaResult]:
    """lambda* for each ``delta`` at level ``epsilon``; the loss matrix is computed once.

    ``scores``/``labels`` are per-problem smoothed scores and cumulative 0/1 labels of
    solvable problems (``orca_method.risk.is_solvable``).
    """
    check_problems(scores, labels, step_tokens)
    deltas = [_check_level(d, "delta") for d in deltas]
    epsilon = _check_level(epsilon, "epsilon")
    grid = default_grid() if grid is None else _check_grid(grid)
    pvalues = pvalue_fn(pvalue)
    n = len(scores)
    lengths = np.array([len(m) for m in scores])
    tau = stop_indices(scores, grid)
    loss_counts = losses(tau, labels).sum(axis=1, dtype=np.int64)
    results = []
    for delta in deltas:
        p = pvalues(loss_counts, n, delta)
        last = n_rejected(p, epsilon) - 1
        lam, tau_star, p_star = (
            (float(grid[last]), tau[last], float(p[last]))
            if last >= 0
            else (NEVER, lengths - 1, 1.0)
        )
        out = summarize(tau_star, lengths, labels, step_tokens)
        results.append(
            DeltaResult(delta, lam, out.error, p_star, out.savings_per_problem,
                        out.savings_total_steps, out.token_savings_total, n)
        )
    return results


@dataclass(frozen=True)
class SplitReplay:
    """LTT over random calibration / test splits of one finite set of traces (`split_replay`)."""

    deltas: tuple[float, ...]
    n_cal: int
    n_test: int
    certified: np.ndarray  # [reps, D] int: the grid index of each split's lambda*, -1 for none
    held_out: np.ndarray  # [reps, D]: the test part's error there (0 for none: never stop)

    def row(self, d: int) -> dict[str, float]:
        """Delta `self.deltas[d]`'s summary: the held-out error's mean, 95th percentile and share
        of splits above delta, and the share of splits that certify no lambda."""
        e, delta = self.held_out[:, d], self.deltas[d]
        return {"delta": delta, "mean_error": float(e.mean()),
                "p95_error": float(np.quantile(e, 0.95)),
                "share_above_delta": float(np.mean(e > delta)),
                "share_none": float(np.mean(self.certified[:, d] < 0))}


def split_replay(loss: np.ndarray, n_cal: int, deltas: Sequence[float], epsilon: float,
                 pvalue: PValue = PValue.BINOMIAL, reps: int = 1000, seed: int = 0) -> SplitReplay:
    """LTT on `reps` random calibration parts of `n_cal` of a set's traces, each lambda* read on
    the rest: how a guarantee is checked on recorded traces when only one finite set exists.

    `loss` is the set's loss matrix over a fixed grid ([m, n], conservative to aggressive, e.g.
    `losses(stop_indices(scores, default_grid()), labels)`), computed once: a split's matrix is
    its columns, so each split costs one p-value vector per delta. LTT bounds by `epsilon` the
    share of calibration draws whose risk at lambda* (the expected loss on fresh traffic)
    exceeds delta; a test part's realized error scatters around that risk by its binomial
    noise, so its share above delta is larger, most where lambda* sits close to delta."""
    loss = np.asarray(loss)
    m, n = loss.shape
    if not 0 < n_cal < n:
        raise ValueError(f"n_cal must leave traces on both sides of a split: 0 < n_cal < {n}, "
                         f"got {n_cal}")
    deltas = tuple(_check_level(d, "delta") for d in deltas)
    pvalues = pvalue_fn(pvalue)
    rng = np.random.default_rng(seed)
    certified = np.full((reps, len(deltas)), -1, dtype=np.int64)
    held_out = np.zeros((reps, len(deltas)))
    for r in range(reps):
        perm = rng.permutation(n)
        cal, test = perm[:n_cal], perm[n_cal:]
        counts = loss[:, cal].sum(axis=1, dtype=np.int64)  # [m]
        for d, delta in enumerate(deltas):
            last = n_rejected(pvalues(counts, n_cal, delta), epsilon) - 1
            if last >= 0:
                certified[r, d] = last
                held_out[r, d] = float(loss[last, test].mean())
    return SplitReplay(deltas=deltas, n_cal=n_cal, n_test=n - n_cal, certified=certified,
                       held_out=held_out)
