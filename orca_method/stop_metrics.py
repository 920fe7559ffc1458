"""Stopping times and the paper's metrics (METHOD.md section 6), shared by LTT and evaluation.

Every function takes ragged per-problem arrays: smoothed scores ``m_1..m_T`` in [0, 1],
cumulative 0/1 labels ``C_1..C_T`` of the same length and, optionally, per-step token
counts. Stop indices are 0-based: ``tau = T - 1`` means "ran to the end". Functions that
take ``tau`` accept shape ``[n_problems]`` or ``[n_lambdas, n_problems]`` so that LTT
(which needs every threshold at once) and reporting (one threshold) use the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The stopping rule and its loss are the risk the live audit measures: one definition, there.
from orca_method.risk import Ragged, losses, stop_indices, values_at  # noqa: F401


def check_problems(
    scores: Ragged, labels: Ragged, step_tokens: Ragged | None = None
) -> None:
    """Raise ValueError on inputs that would silently give wrong stop times or losses."""
    if len(scores) == 0:
        raise ValueError("no problems: the calibration set is empty")
    if len(labels) != len(scores):
        raise ValueError(f"{len(scores)} score arrays but {len(labels)} label arrays")
    if step_tokens is not None and len(step_tokens) != len(scores):
        raise ValueError(f"{len(scores)} score arrays but {len(step_tokens)} token arrays")
    for i, (m, c) in enumerate(zip(scores, labels)):
        m, c = np.asarray(m), np.asarray(c)
        if m.ndim != 1 or m.size == 0:
            raise ValueError(f"problem {i}: scores must be a non-empty 1-D array")
        if c.shape != m.shape:
            raise ValueError(f"problem {i}: {m.size} scores but {c.size} labels")
        # NaN would corrupt the binary search; values outside [0, 1] mean logits were passed.
        if not np.all((m >= 0.0) & (m <= 1.0)):
            raise ValueError(f"problem {i}: scores must be finite and in [0, 1]")
        if not np.all((c == 0) | (c == 1)):
            raise ValueError(f"problem {i}: labels must be 0/1")
        if step_tokens is not None:
            k = np.asarray(step_tokens[i])
            if k.shape != m.shape:
                raise ValueError(f"problem {i}: {m.size} scores but {k.size} token counts")
            if not np.all(k >= 0):
                raise ValueError(f"problem {i}: token counts must be >= 0")


def step_savings(tau: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``savings_total_steps = 1 - sum(tau + 1) / sum(T)`` (a ratio of means) over the last axis.

    Long problems weigh more here than in the paper's figure (`savings_per_problem`).
    """
    return 1.0 - (tau + 1).mean(axis=-1) / np.mean(lengths)


def token_savings(tau: np.ndarray, step_tokens: Ragged) -> np.ndarray:
    """``token_savings_total = 1 - sum(tokens up to and including tau) / sum(all tokens)``."""
    used = values_at([np.cumsum(k) for k in step_tokens], tau).sum(axis=-1)
    total = sum(float(np.sum(k)) for k in step_tokens)
    if total <= 0:
        raise ValueError("token savings need a positive total token count")
    return 1.0 - used / total


@dataclass(frozen=True)
class StopOutcome:
    """Metrics of one stopping rule on a set of problems (METHOD.md section 6).

    Two definitions of savings, both reported, never to be confused:
    - ``savings_per_problem``: mean over problems of ``1 - tau_i / T_i``. This is the figure in
      the paper's tables (its per-problem savings distribution has the headline value as its
      mean); compare with the paper on this one only.
    - ``savings_total_steps``: ``1 - sum(tau_i) / sum(T_i)``, the share of all reasoning steps
      saved (what a server's bill sees). Long problems weigh more.
    The token versions are the same two definitions with tokens in place of steps.
    """

    savings_per_problem: float
    savings_total_steps: float
    median_savings_per_problem: float
    token_savings_per_problem: float | None
    token_savings_total: float | None
    error: float
    n: int


def summarize(
    tau: np.ndarray,
    lengths: np.ndarray,
    labels: Ragged,
    step_tokens: Ragged | None = None,
) -> StopOutcome:
    """Metrics for 0-based stop indices ``tau`` of shape ``[n_problems]``."""
    tau = np.asarray(tau)
    lengths = np.asarray(lengths)
    if tau.ndim != 1 or tau.shape != lengths.shape or tau.size != len(labels):
        raise ValueError("tau, lengths and labels must describe the same problems")
    if np.any(lengths != [len(c) for c in labels]):
        raise ValueError("lengths must equal the number of labels of each problem")
    if np.any(tau < 0) or np.any(tau >= lengths):
        raise ValueError("tau must satisfy 0 <= tau < T for every problem")
    per_problem = 1.0 - (tau + 1) / lengths
    tok_problem = tok_total = None
    if step_tokens is not None:
        used = values_at([np.cumsum(k) for k in step_tokens], tau)
        totals = np.array([float(np.sum(k)) for k in step_tokens])
        if np.any(totals <= 0):
            raise ValueError("token savings need a positive token count for every problem")
        tok_problem = float(np.mean(1.0 - used / totals))
        tok_total = float(token_savings(tau, step_tokens))
    return StopOutcome(
        savings_per_problem=float(per_problem.mean()),
        savings_total_steps=float(step_savings(tau, lengths)),
        median_savings_per_problem=float(np.median(per_problem)),
        token_savings_per_problem=tok_problem,
        token_savings_total=tok_total,
        error=float(losses(tau, labels).mean()),
        n=int(tau.size),
    )
