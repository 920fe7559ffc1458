"""The per-request shift gate: is this request like the calibration set, decided on its first steps.

LTT's guarantee holds for requests exchangeable with the calibration split. The gate tests that
premise for each request, without labels, before any lambda* may stop it: a nonconformity score
of the request's gate features (the mean of its first `steps` step embeddings, the vectors the
probe reads anyway) against a reference fitted on the training split, turned into a conformal
p-value against the calibration split's own scores:

    p = (1 + #{i : s_i >= s}) / (n + 1)

Under exchangeability of the request with the n calibration requests, P(p <= alpha) <= alpha
(split conformal, Vovk et al. 2005; Angelopoulos & Bates 2021): on in-distribution traffic at
most alpha of requests are flagged. A flagged request is served by the operator's safe action
(the bundle's largest lambda* by default), so on traffic the gate catches the stop error is
that action's.

Two levels, one p-value: the stop side's `alpha` (p <= alpha: flagged, served the safe action,
never gives up) and the give-up side's `give_up_alpha` >= alpha (p <= give_up_alpha: never gives
up, stops as usual). The same bound holds for each: on in-distribution traffic at most alpha of
requests are flagged and at most give_up_alpha are denied their give-up. The give-up side's
level may be the higher one because giving up wrongly under shift is the costlier error there
and denying a give-up costs tokens only (docs/METHOD.md section 11).

The score: a Mahalanobis distance in the top `rank` principal directions of the training
features plus the squared residual outside them, scaled by its training mean (PCA Mahalanobis
with a residual term, as in feature-space out-of-distribution detection, Lee et al. 2018). It is
O(d * rank) per request, and the reference is O(d * rank) numbers whatever the model's size.

Flagging at level alpha is `s > threshold(alpha)`: with sorted calibration scores s_(1..n) and
k = n + 1 - floor(alpha (n + 1)), p <= alpha exactly when s > s_(k) (never when k > n). The
engine compares on the device against the request's threshold; the host computes p for the
report from the score read back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import Tensor

DEFAULT_GATE_STEPS = 1  # steps whose embeddings the gate reads: decided at the first step
# The levels the job writes into a bundle (and the demo bundles carry): in-distribution requests
# flagged, at most, and denied their give-up, at most. The stop side's 0.035 keeps the savings the
# gate costs in distribution within 2 points; the give-up side's 0.05 keeps two-sided stopping
# safe on shifted traffic the stop side's lower level lets through (benchmarks/RESULTS-archive.md,
# "The shift action and the gate's level").
DEFAULT_GATE_ALPHA = 0.035
DEFAULT_GATE_GIVE_UP_ALPHA = 0.05
DEFAULT_GATE_RANK = 32  # principal directions kept (on the toy, 16 misses half its shift)
_EPS = 1e-6


def gate_features(step_embeddings: Sequence[np.ndarray], steps: int) -> np.ndarray | None:
    """The gate's features of one trajectory: the mean of its first `steps` step embeddings.

    None when the trajectory has fewer than `steps + 1` steps: the server never scores a trace's
    last step (the end of thinking closes it), so a request that short is never gated."""
    e = np.asarray(step_embeddings, dtype=np.float64)
    if e.ndim != 2 or e.shape[0] < steps + 1:
        return None
    return e[:steps].mean(axis=0)


def fit_gate(fit: np.ndarray, cal: np.ndarray, rank: int = DEFAULT_GATE_RANK
             ) -> tuple[dict[str, np.ndarray], list[float]]:
    """The reference's tensors from the training split's features and the calibration split's
    sorted scores. fit: [N, d], cal: [M, d] (disjoint sets of requests: the p-values are valid
    for requests exchangeable with `cal`, whatever `fit` is). The calibration scores come from
    `ShiftGate.score`, the code the engine scores requests with, in its float32: a score computed
    any other way would not be exchangeable with the live ones."""
    import torch  # deferred: the CLI reads this module's defaults without torch

    fit = np.asarray(fit, dtype=np.float64)
    cal = np.asarray(cal, dtype=np.float64)
    if fit.ndim != 2 or cal.ndim != 2 or fit.shape[1] != cal.shape[1]:
        raise ValueError(f"gate features must be [N, d] and [M, d], got {fit.shape} and "
                         f"{cal.shape}")
    if fit.shape[0] < 2 or cal.shape[0] < 1:
        raise ValueError(f"the gate needs >= 2 fitting and >= 1 calibration requests, got "
                         f"{fit.shape[0]} and {cal.shape[0]}")
    mean = fit.mean(axis=0)  # [d]
    centred = fit - mean
    _, sv, vt = np.linalg.svd(centred, full_matrices=False)
    r = max(1, min(rank, fit.shape[0] - 1, fit.shape[1]))
    basis = vt[:r]  # [r, d]
    var = sv[:r] ** 2 / (fit.shape[0] - 1) + _EPS  # [r]
    resid = centred - (centred @ basis.T) @ basis  # [N, d]
    res_scale = float((resid ** 2).sum(axis=1).mean()) + _EPS
    tensors = {k: np.asarray(v, dtype=np.float32) for k, v in
               {"mean": mean, "basis": basis, "var": var, "res_scale": [res_scale]}.items()}
    gate = ShiftGate({k: torch.from_numpy(v) for k, v in tensors.items()}, [0.0], 1, 0.5)
    scores = gate.score(torch.from_numpy(cal)).tolist()
    return tensors, sorted(float(s) for s in scores)


def flag_count(n: int, alpha: float) -> int:
    """m = floor(alpha (n + 1)): a request is flagged at level alpha when at most m - 1 of the n
    calibration scores are >= its own (p <= alpha), i.e. when it exceeds the (n + 1 - m)-th
    smallest. One definition, shared by the threshold and the gate alarm's reading of p."""
    return math.floor(alpha * (n + 1))


def threshold(scores: Sequence[float], alpha: float) -> float:
    """The score above which a request is flagged at level alpha (module docstring); inf when
    no request can be (alpha below 1 / (n + 1), or alpha = 0: the gate off)."""
    n = len(scores)
    k = n + 1 - flag_count(n, alpha)
    if k < 1:  # alpha = 1: every request
        return -math.inf
    return math.inf if k > n else float(scores[k - 1])


def pvalue(scores: Sequence[float], s: float) -> float:
    """The conformal p-value of score `s` against the sorted calibration scores."""
    n = len(scores)
    at_least = n - int(np.searchsorted(np.asarray(scores), s, side="left"))
    return (1 + at_least) / (n + 1)


def give_up_level(alpha: float, give_up_alpha: float | None) -> float:
    """The give-up side's level beside the stop side's `alpha` (None: alpha's, one level for
    both: what a bundle without the block's give_up_alpha means). ValueError when it is below
    alpha: a flagged request never gives up, so a lower give-up level would mean nothing."""
    if give_up_alpha is None:
        return alpha
    if give_up_alpha < alpha:
        raise ValueError(f"the give-up side's gate level ({give_up_alpha:g}) must be at least the "
                         f"stop side's ({alpha:g}): a request the gate flags never gives up")
    return give_up_alpha


class ShiftGate:
    """A bundle's gate on a device: `score` for a batch of feature rows, thresholds and p-values
    on the host (see the module docstring). `alpha` and `give_up_alpha` are the bundle's levels
    (give_up_alpha None: one level, the stop side's, whatever a request sets it to)."""

    def __init__(self, tensors: dict[str, Tensor], scores: Sequence[float], steps: int,
                 alpha: float, device: str | torch.device = "cpu",
                 give_up_alpha: float | None = None) -> None:
        import torch  # deferred: the CLI reads this module's defaults without torch

        self.steps, self.alpha = int(steps), float(alpha)
        give_up_level(self.alpha, give_up_alpha)  # ValueError below alpha
        self.give_up_alpha = None if give_up_alpha is None else float(give_up_alpha)
        self.scores = [float(s) for s in scores]
        dev = torch.device(device)
        self.mean = tensors["mean"].to(dev, torch.float32)  # [d]
        self.basis = tensors["basis"].to(dev, torch.float32)  # [r, d]
        self.var = tensors["var"].to(dev, torch.float32)  # [r]
        self.res_scale = float(tensors["res_scale"].reshape(-1)[0])

    def score(self, x: Tensor) -> Tensor:
        """x: [m, d] gate features -> [m] nonconformity scores (no host sync; no autograd: the
        inputs never require grad)."""
        c = x.float() - self.mean  # [m, d]
        z = c @ self.basis.T  # [m, r]
        # the residual outside the basis, formed directly: |c|^2 - |z|^2 cancels catastrophically
        # in float32 when the basis holds nearly all of c
        resid = c - z @ self.basis  # [m, d]
        return (z.square() / self.var).sum(1) + resid.square().sum(1) / self.res_scale

    def threshold(self, alpha: float) -> float:
        return threshold(self.scores, alpha)

    def levels(self, alpha: float | None = None, give_up_alpha: float | None = None
               ) -> tuple[float, float]:
        """The (stop, give-up) levels a request runs with: its own where it has them, else the
        bundle's; a bundle without a give-up level has one level, the stop side's (as it had
        before the field). Alpha 0 turns the gate off on both sides (0, 0). A give-up level
        below the stop level is raised to it (a flagged request never gives up): the server
        refuses a request that asks for that itself (orca_serve.settings.resolve), so only a
        default give-up level is ever raised."""
        a = self.alpha if alpha is None else float(alpha)
        if a == 0:
            return 0.0, 0.0
        g = give_up_alpha if give_up_alpha is not None else self.give_up_alpha
        return a, a if g is None else max(a, float(g))

    def thresholds(self, alpha: float | None = None, give_up_alpha: float | None = None
                   ) -> tuple[float, float]:
        """The score thresholds of `levels` (stop, give-up; give-up <= stop; inf: off)."""
        a, g = self.levels(alpha, give_up_alpha)
        return self.threshold(a), self.threshold(g)

    def pvalue(self, s: float) -> float:
        return pvalue(self.scores, s)
