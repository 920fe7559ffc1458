"""The risk LTT certifies, as one definition shared by calibration and the live audit.

Learn-then-Test (orca_method/ltt.py) bounds ``risk(lambda) = P(loss = 1)`` with the 0/1 loss
of one trajectory under threshold ``lambda``: the deployed procedure stops at the first step
whose smoothed score ``m_t >= lambda`` (the last step when it never crosses), and the loss is 1
when the cumulative label there is 0, i.e. the answer at the stop step is not yet right. The
audit of a live request measures the same loss on the same scores: a request audited in shadow
mode never stops, so its recorded scores are a never-stopping replay and the first crossing is
the step where the deployed procedure would have stopped. Calibration's metrics
(orca_method/stop_metrics.py) import these functions; there is no second copy.

Trajectories whose labels never reach 1 ("never correct") are excluded from the calibrated
risk when the bundle says so (``LTTTable.excluded_never_correct``); callers drop them before
feeding losses to a confidence sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from orca_method.bundle import Bundle

Ragged = Sequence[np.ndarray]


def stop_indices(scores: Ragged, lambdas: np.ndarray) -> np.ndarray:
    """0-based ``tau[j, i] = min{t : m_it >= lambda_j}``, or ``T_i - 1`` if never crossed.

    The first crossing of ``lambda`` equals the first index where the prefix maximum reaches
    it, and the prefix maximum is sorted, so each problem is one ``searchsorted`` over all
    thresholds. ``lambda = +inf`` never stops early.
    """
    lambdas = np.asarray(lambdas, dtype=float)
    if lambdas.ndim != 1 or np.isnan(lambdas).any():
        raise ValueError("lambdas must be a 1-D array without NaN")
    tau = np.empty((len(scores), lambdas.size), dtype=np.intp)
    for i, m in enumerate(scores):
        prefix_max = np.maximum.accumulate(np.asarray(m, dtype=float))
        first = np.searchsorted(prefix_max, lambdas, side="left")
        tau[i] = np.minimum(first, prefix_max.size - 1)
    return tau.T


def values_at(arrays: Ragged, tau: np.ndarray) -> np.ndarray:
    """``out[..., i] = arrays[i][tau[..., i]]`` as a single gather over the packed arrays."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.intp, count=len(arrays))
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    flat = np.concatenate([np.asarray(a) for a in arrays])
    return flat[offsets + tau]


def losses(tau: np.ndarray, labels: Ragged) -> np.ndarray:
    """0/1 loss ``1 - C_i[tau_i]`` (int8) for cumulative labels ``C``, same shape as ``tau``."""
    return 1 - values_at([np.asarray(c, dtype=np.int8) for c in labels], tau)


def cumulative(labels: Sequence[int] | np.ndarray) -> np.ndarray:
    """Cumulative 0/1 labels (all 1 after the first 1): stopping once correct counts as correct."""
    return np.maximum.accumulate(np.asarray(labels, dtype=np.int8), axis=-1)


def is_solvable(labels: Sequence[int] | np.ndarray) -> bool:
    """Whether a trajectory is right at some step; LTT's risk is about these (METHOD.md
    section 3: the never-correct ones have loss 1 at every threshold)."""
    return bool(np.any(np.asarray(labels) == 1))


def request_losses(scores: Sequence[float], labels: Sequence[int],
                   lambdas: Sequence[float]) -> np.ndarray:
    """The loss of one trajectory under each threshold of ``lambdas`` (int8 ``[len(lambdas)]``).

    ``scores`` are the smoothed scores of every step (a never-stopping run), ``labels`` the raw
    or cumulative 0/1 labels of the same steps (cumulated here: once right counts as right).
    """
    m = np.asarray(scores, dtype=float)
    c = cumulative(labels)
    if m.ndim != 1 or m.size == 0 or c.shape != m.shape:
        raise ValueError(f"need one score per labelled step, got {m.size} scores for "
                         f"{c.size} labels")
    if np.isnan(m).any():
        raise ValueError("scores must not be NaN")
    tau = stop_indices([m], np.asarray(lambdas, dtype=float))  # [n_lambdas, 1]
    return losses(tau, [c])[:, 0]


def request_loss(scores: Sequence[float], labels: Sequence[int], lam: float) -> int:
    """The loss of one audited request under threshold ``lam`` (inf: never stops, loss
    ``1 - C_T``, i.e. 0 whenever the final step is labelled right)."""
    return int(request_losses(scores, labels, [lam])[0])


def stops_before_end(scores: Sequence[float], lam: float) -> bool:
    """Whether the procedure under ``lam`` stops strictly before the last recorded step: some
    smoothed score before the last one reaches ``lam``.

    For a trajectory that did not finish (cut by max_tokens, aborted) this is whether the stop
    at ``lam`` came before the end of the recording; then the loss at ``lam`` is the label at
    that stop, which the recorded steps determine (docs/METHOD.md section 10), and only the
    thresholds that stop later have an unknown loss.
    """
    m = np.asarray(scores, dtype=float)
    return bool(m.size > 1 and np.any(m[:-1] >= lam))


def is_counted(labels: Sequence[int], excluded_never_correct: bool = True) -> bool:
    """Whether a trajectory enters the calibrated risk: not when its labels are all 0 and the
    bundle excluded never-correct trajectories (their loss is 1 at every threshold)."""
    return not excluded_never_correct or is_solvable(labels)


def table_losses(bundle: Bundle, scores: Sequence[float],
                 labels: Sequence[int]) -> dict[float, int]:
    """``{delta: loss at the bundle's lambda*(delta)}`` for every row of the LTT table."""
    deltas = bundle.deltas()
    lams = [bundle.lam(d) for d in deltas]
    return {d: int(x) for d, x in zip(deltas, request_losses(scores, labels, lams))}

