"""Label-free recalibration under covariate shift (docs/METHOD.md section 13).

LTT (orca_method/ltt.py) certifies lambda* for requests exchangeable with the calibration split.
When the traffic's requests are drawn from another distribution q of the gate's features x (the
mean of a request's first step embeddings, orca_method/shift_gate.py) while the loss given x is
unchanged (covariate shift: P(loss | x) is the same under p and q), the calibration traces can be
re-drawn to look like the traffic, without a single label of it:

1. **Density ratio.** A logistic regression tells reference features (drawn like the calibration
   split, but other requests: the job's training split) from traffic features; its odds, times
   n_ref / n_traffic, estimate w(x) = q(x) / p(x) (the classifier route to a density ratio,
   e.g. Sugiyama, Suzuki & Kanamori 2012; the one weighted conformal prediction uses,
   Tibshirani et al. 2019). The calibration traces are not used to fit it, so their weights are
   a fixed function of their own features.
2. **Rejection sampling** (as PAC prediction sets under covariate shift do, Park et al. 2022):
   with B >= w everywhere, keep calibration trace i with probability w(x_i) / B. A kept trace
   is then a draw from q (features) with the losses p has for them, which under covariate shift
   are q's: the kept traces are i.i.d. traffic-like traces, each kept independently.
3. **LTT on the kept traces**, unchanged (`orca_method.ltt.calibrate`): the binomial test and
   fixed-sequence testing over the grid give P(risk_q(lambda*) <= delta) >= 1 - epsilon.

What the estimate costs: with estimated weights w_hat clipped at B, the kept traces are draws
from q_hat ~ p min(w_hat, B), and the statement holds for q_hat; the traffic's risk can exceed
it by at most the total-variation distance between q and q_hat (losses are in [0, 1]). B is the
largest weight over the features the classifier was fitted on (traffic features included, so
the traffic's most unusual requests set it); about n / B traces are kept, so where the traffic
lies outside the calibration set's support, B is large, few traces are kept and LTT certifies
little or nothing: the method abstains rather than extrapolates. Two numbers say how far the
traffic is: the calibration weights' mean (about 1 when the traffic lies within the calibration
set's support; far below 1 when its mass lies where no calibration trace is) and their effective
sample size (sum w)^2 / sum w^2 (how unequal they are; blind to their scale).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.special import expit, log_expit

from orca_method.ltt import DEFAULT_EPSILON, DeltaResult, calibrate
from orca_method.outcomes import PValue
from orca_method.stop_metrics import Ragged
from orca_method.thresholds import NEVER

DEFAULT_RATIO_RANK = 16  # principal directions the classifier reads (the gate keeps 32-64)
L2_GRID = (1e-3, 1e-2, 1e-1, 1.0, 10.0)  # ridge strengths tried, chosen by cross-validation
CV_FOLDS = 5
_EPS = 1e-8


@dataclass(frozen=True)
class DensityRatio:
    """w(x) = q(x) / p(x) estimated by a logistic regression on standardised principal
    components of the pooled fitting features. mean: [d], basis: [r, d], scale: [r],
    coef: [r]; `log_prior` = log(n_ref / n_traffic) turns the odds into the ratio."""

    mean: np.ndarray
    basis: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    log_prior: float
    l2: float  # the ridge strength cross-validation chose

    def log_weights(self, x: np.ndarray) -> np.ndarray:
        """x: [m, d] -> [m] log w(x)."""
        z = ((np.asarray(x, dtype=np.float64) - self.mean) @ self.basis.T) / self.scale  # [m, r]
        return z @ self.coef + self.intercept + self.log_prior

    def weights(self, x: np.ndarray) -> np.ndarray:
        return np.exp(self.log_weights(x))


def _fit_logistic(z: np.ndarray, y: np.ndarray, l2: float) -> tuple[np.ndarray, float]:
    """Ridge logistic regression (mean log-loss + l2/2 |coef|^2, intercept free), by Newton's
    method with step halving: r + 1 <= 65 unknowns, so each step is one small solve. z: [n, r]."""
    n, r = z.shape
    a = np.hstack([z, np.ones((n, 1))])  # [n, r + 1]
    ridge = np.full(r + 1, l2)
    ridge[r] = _EPS  # the intercept is not penalised

    def objective(theta: np.ndarray) -> float:
        logit = a @ theta
        return float(-(y * log_expit(logit) + (1 - y) * log_expit(-logit)).mean()
                     + 0.5 * l2 * theta[:r] @ theta[:r])

    theta = np.zeros(r + 1)
    f = objective(theta)
    for _ in range(100):
        p = expit(a @ theta)  # [n]
        grad = a.T @ (p - y) / n + ridge * theta
        hess = (a * (p * (1 - p))[:, None]).T @ a / n + np.diag(ridge)
        step = np.linalg.solve(hess, grad)
        t = 1.0
        while t > 1e-6 and objective(theta - t * step) > f:
            t /= 2
        theta = theta - t * step
        f_new = objective(theta)
        if f - f_new < 1e-12:
            break
        f = f_new
    return theta[:r], float(theta[r])


def _log_loss(z: np.ndarray, y: np.ndarray, coef: np.ndarray, b: float) -> float:
    logit = z @ coef + b
    return float(-(y * log_expit(logit) + (1 - y) * log_expit(-logit)).mean())


def fit_density_ratio(ref: np.ndarray, traffic: np.ndarray, *, rank: int = DEFAULT_RATIO_RANK,
                      l2_grid: Sequence[float] = L2_GRID, folds: int = CV_FOLDS,
                      seed: int = 0) -> DensityRatio:
    """The classifier reference-vs-traffic on gate features (ref: [n0, d], traffic: [n1, d];
    `ref` drawn like the calibration split but disjoint from it). The ridge strength is the one
    with the best `folds`-fold held-out log-loss: the weights are as extreme as the data say,
    and no more (an unregularised classifier separates any two samples in d >> n dimensions)."""
    ref, traffic = (np.asarray(a, dtype=np.float64) for a in (ref, traffic))
    if ref.ndim != 2 or traffic.ndim != 2 or ref.shape[1] != traffic.shape[1]:
        raise ValueError(f"features must be [n, d] and [m, d], got {ref.shape} and "
                         f"{traffic.shape}")
    if len(ref) < folds or len(traffic) < folds:
        raise ValueError(f"the density ratio needs >= {folds} reference and traffic requests, "
                         f"got {len(ref)} and {len(traffic)}")
    x = np.vstack([ref, traffic])  # [n, d]
    y = np.concatenate([np.zeros(len(ref)), np.ones(len(traffic))])  # [n]
    mean = x.mean(axis=0)  # [d]
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    basis = vt[:max(1, min(rank, len(x) - 1, x.shape[1]))]  # [r, d]
    proj = (x - mean) @ basis.T  # [n, r]
    scale = proj.std(axis=0) + _EPS  # [r]
    z = proj / scale
    fold = np.random.default_rng(seed).permutation(len(x)) % folds  # [n]
    cv = []
    for l2 in l2_grid:
        held = 0.0
        for k in range(folds):
            coef, b = _fit_logistic(z[fold != k], y[fold != k], l2)
            held += _log_loss(z[fold == k], y[fold == k], coef, b) * np.sum(fold == k)
        cv.append(held / len(x))
    l2 = float(l2_grid[int(np.argmin(cv))])
    coef, b = _fit_logistic(z, y, l2)
    return DensityRatio(mean=mean, basis=basis, scale=scale, coef=coef, intercept=b,
                        log_prior=float(np.log(len(ref) / len(traffic))), l2=l2)


def effective_size(weights: np.ndarray) -> float:
    """Kish's effective sample size (sum w)^2 / sum w^2: n for equal weights, 1 for one."""
    w = np.asarray(weights, dtype=np.float64)
    return float(w.sum() ** 2 / (w ** 2).sum()) if w.size and w.any() else 0.0


@dataclass(frozen=True)
class Resample:
    """Which calibration traces rejection sampling kept, and what it was drawn with."""

    weights: np.ndarray  # [n] w_hat of each calibration trace, clipped at `bound`
    bound: float  # B: the acceptance probability is weight / B
    kept: np.ndarray  # [n] bool
    clipped: int  # calibration traces whose weight exceeded B
    n_eff: float  # effective_size of the (clipped) calibration weights
    seed: int

    def facts(self) -> dict[str, float | int]:
        """The numbers a recalibrated bundle's provenance records."""
        return {"n_cal": int(self.kept.size), "n_kept": int(self.kept.sum()),
                "bound": round(self.bound, 6), "mean_weight": round(float(self.weights.mean()), 6),
                "n_eff": round(self.n_eff, 3),
                "clipped": self.clipped, "seed": self.seed}


def resample(ratio: DensityRatio, cal: np.ndarray, fitted: np.ndarray, *, seed: int = 0,
             clip: float | None = None) -> Resample:
    """Rejection sampling of the calibration traces (features cal: [n, d]) towards the traffic.

    B is the largest weight over `fitted` (the features the ratio was fitted on, traffic ones
    included: not the calibration traces, so that B is fixed for them), capped at `clip` when
    given; calibration weights above B are clipped to it (counted in `clipped`; the statement
    then holds for the clipped q_hat, module docstring)."""
    w = ratio.weights(cal)  # [n]
    bound = float(ratio.weights(fitted).max())
    if clip is not None:
        if not 0 < clip < math.inf:  # nan too: it compared as no cap
            raise ValueError(f"the weight cap must be a number > 0, got {clip}")
        bound = min(bound, float(clip))
    clipped = int(np.sum(w > bound))
    w = np.minimum(w, bound)
    kept = np.random.default_rng(seed).random(w.size) < w / bound
    return Resample(weights=w, bound=bound, kept=kept, clipped=clipped,
                    n_eff=effective_size(w), seed=seed)


def weighted_calibrate(scores: Ragged, labels: Ragged, kept: np.ndarray,
                       deltas: Sequence[float], *, epsilon: float = DEFAULT_EPSILON,
                       grid: np.ndarray | None = None, pvalue: PValue = PValue.BINOMIAL,
                       step_tokens: Ragged | None = None) -> list[DeltaResult]:
    """LTT (`orca_method.ltt.calibrate`) on the kept solvable calibration traces (`kept`: [n]
    bool over the problems given); none kept: no threshold is certified (never stop early)."""
    idx = np.flatnonzero(np.asarray(kept, dtype=bool))
    if idx.size == 0:
        return [DeltaResult(float(d), NEVER, 0.0, 1.0, 0.0, 0.0,
                            None if step_tokens is None else 0.0, 0) for d in deltas]
    return calibrate([scores[i] for i in idx], [labels[i] for i in idx], deltas,
                     epsilon=epsilon, grid=grid, pvalue=pvalue,
                     step_tokens=None if step_tokens is None else [step_tokens[i] for i in idx])
