"""Label-free recalibration under covariate shift (orca_method/covariate_shift.py): the density
ratio, rejection sampling, and the weighted LTT's guarantee tested by repeated simulation on a
population with a known covariate shift (the loss given the features unchanged)."""

from __future__ import annotations

import numpy as np
import pytest

from orca_method.covariate_shift import (
    effective_size,
    fit_density_ratio,
    resample,
    weighted_calibrate,
)
from orca_method.ltt import calibrate, default_grid
from orca_method.risk import losses, stop_indices

D, T = 6, 12
DELTAS = (0.1, 0.2)
EPSILON = 0.05


def _draw(rng: np.random.Generator, n: int, shift: float
          ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Features x ~ N(shift (e1 + e2), I) and traces whose answer appears at a step drawn
    independently of x, with scores that run ahead of the answer as x_1 grows: the loss given x
    is the same at every shift (covariate shift), its mean is not. x_2 shifts too and does not
    matter to the loss (the classifier must not be fooled into weights that do harm)."""
    x = rng.normal(size=(n, D))
    x[:, :2] += shift
    answer = rng.integers(2, 10, size=n)  # [n]
    t = np.arange(T)
    logit = 1.5 * (t[None] - answer[:, None]) + 1.5 * x[:, :1] + rng.normal(size=(n, T))
    scores = 1 / (1 + np.exp(-logit))  # [n, T]
    labels = (t[None] >= answer[:, None]).astype(np.int8)
    return x, list(scores), list(labels)


def _risk_table(shift: float) -> dict[float, float]:
    """The population stop risk of every grid threshold (and never) at this shift."""
    _, s, c = _draw(np.random.default_rng(99), 20_000, shift)
    grid = np.append(default_grid(), np.inf)
    risk = losses(stop_indices(s, grid), c).mean(axis=1)
    return dict(zip(grid.tolist(), risk.tolist()))


def _simulate(shift: float, reps: int, seed: int) -> dict[str, np.ndarray]:
    """`reps` calibrations: reference features (400, in distribution), calibration traces (500,
    in distribution), traffic features (300, at `shift`); the population risk at the traffic's
    shift of the unweighted and the weighted lambda* per delta."""
    rng = np.random.default_rng(seed)
    risk = _risk_table(shift)
    out: dict[str, list] = {"unweighted": [], "weighted": [], "lam_u": [], "lam_w": [],
                            "n_eff": []}
    for r in range(reps):
        ref, _, _ = _draw(rng, 400, 0.0)
        cal_x, cal_s, cal_c = _draw(rng, 500, 0.0)
        traffic, _, _ = _draw(rng, 300, shift)
        plain = calibrate(cal_s, cal_c, DELTAS, epsilon=EPSILON)
        ratio = fit_density_ratio(ref, traffic, seed=r)
        rs = resample(ratio, cal_x, np.vstack([ref, traffic]), seed=r)
        weighted = weighted_calibrate(cal_s, cal_c, rs.kept, DELTAS, epsilon=EPSILON)
        out["unweighted"].append([risk[x.lam] for x in plain])
        out["weighted"].append([risk[x.lam] for x in weighted])
        out["lam_u"].append([x.lam for x in plain])
        out["lam_w"].append([x.lam for x in weighted])
        out["n_eff"].append(rs.n_eff)
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("reps", [100, pytest.param(400, marks=pytest.mark.slow)])
def test_weighted_lambda_keeps_the_risk_under_shift_where_the_unweighted_breaks_it(reps):
    """Traffic shifted by 0.5 sd along the loss's feature: the in-distribution lambda* has
    traffic risk above delta in nearly every draw; the weighted one in at most epsilon of the
    draws, up to 3 binomial standard errors (100 draws, seed 0: tolerance 0.065; 400 with
    -m slow: 0.033). The weights are estimated, so the bound is approximate; this population's
    is well within it."""
    sim = _simulate(0.5, reps, seed=0)
    over_u = (sim["unweighted"] > np.array(DELTAS)).mean(axis=0)
    over_w = (sim["weighted"] > np.array(DELTAS)).mean(axis=0)
    tol = 3 * np.sqrt(EPSILON * (1 - EPSILON) / reps)
    assert np.all(over_u >= 0.9), over_u
    assert np.all(over_w <= EPSILON + tol), over_w
    # and it still stops early: a finite lambda* in most draws at delta 0.2
    assert np.isfinite(sim["lam_w"][:, 1]).mean() >= 0.9


def test_without_shift_the_weighted_lambda_stays_near_the_unweighted():
    """Traffic from the calibration distribution: the weights stay near 1 (n_eff near n), the
    weighted lambda* is within 0.03 of the unweighted on average and keeps the risk (60 draws,
    seed 1; the same tolerance rule)."""
    reps = 60
    sim = _simulate(0.0, reps, seed=1)
    assert sim["n_eff"].mean() >= 0.95 * 500
    assert np.all(np.isfinite(sim["lam_w"]))
    assert np.all(np.abs(sim["lam_w"].mean(axis=0) - sim["lam_u"].mean(axis=0)) <= 0.03)
    over_w = (sim["weighted"] > np.array(DELTAS)).mean(axis=0)
    assert np.all(over_w <= EPSILON + 3 * np.sqrt(EPSILON * (1 - EPSILON) / reps)), over_w


def test_the_ratio_recovers_a_known_gaussian_shift():
    """q = N(mu, I), p = N(0, I): log w(x) = mu . x - |mu|^2 / 2. The estimate tracks it and
    averages to 1 over p (the classifier's odds times n_ref / n_traffic)."""
    rng = np.random.default_rng(2)
    mu = np.zeros(D)
    mu[0] = 0.7
    ref = rng.normal(size=(2000, D))
    traffic = rng.normal(size=(2000, D)) + mu
    ratio = fit_density_ratio(ref, traffic)
    x = rng.normal(size=(5000, D))
    truth = x @ mu - mu @ mu / 2
    est = ratio.log_weights(x)
    assert np.corrcoef(est, truth)[0, 1] > 0.98
    assert abs(np.exp(est).mean() - 1.0) < 0.05


def test_disjoint_traffic_keeps_nothing_and_certifies_nothing():
    """Traffic far outside the calibration support: B is huge, the calibration weights average
    far below 1 (the traffic's mass lies where no calibration trace is; n_eff, blind to scale,
    cannot say this), (nearly) nothing is kept, and no threshold is certified: the method
    abstains instead of extrapolating."""
    rng = np.random.default_rng(3)
    ref, _, _ = _draw(rng, 300, 0.0)
    cal_x, cal_s, cal_c = _draw(rng, 300, 0.0)
    traffic, _, _ = _draw(rng, 300, 6.0)
    rs = resample(fit_density_ratio(ref, traffic), cal_x, np.vstack([ref, traffic]))
    assert rs.bound > 100 and rs.weights.mean() < 0.05 and rs.kept.sum() <= 1
    res = weighted_calibrate(cal_s, cal_c, rs.kept, DELTAS, step_tokens=[np.ones(T)] * 300)
    assert all(r.lam == np.inf and r.n == 0 and r.token_savings_total == 0.0 for r in res)


def test_resample_clip_and_kish_size():
    rng = np.random.default_rng(4)
    ref, traffic = rng.normal(size=(200, D)), rng.normal(size=(200, D)) + 1.0
    ratio = fit_density_ratio(ref, traffic)
    cal = rng.normal(size=(400, D))
    free = resample(ratio, cal, np.vstack([ref, traffic]), seed=5)
    capped = resample(ratio, cal, np.vstack([ref, traffic]), seed=5, clip=2.0)
    assert capped.bound == 2.0 and capped.weights.max() <= 2.0
    assert capped.clipped == int(np.sum(ratio.weights(cal) > 2.0)) > 0
    assert capped.kept.sum() > free.kept.sum()  # a lower bound keeps more (and clips)
    assert effective_size(np.ones(10)) == pytest.approx(10)
    assert effective_size(np.array([1.0, 0, 0])) == pytest.approx(1)
    with pytest.raises(ValueError, match="cap"):
        resample(ratio, cal, ref, clip=0.0)
    with pytest.raises(ValueError, match="features must be"):
        fit_density_ratio(ref, traffic[:, :3])
