"""benchmarks/bench_samples_frontier.py: the rolling launch and the stricter first pair on
hand-made groups, the launch chosen out of fold, and LTT over a rolling launch tested
statistically (repeated simulation, fixed seed, stated tolerance)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_samples_frontier import (  # noqa: E402
    CANDIDATES,
    Candidate,
    agreement_weights,
    chosen_fit,
    rolling,
    stricter_first,
)

from orca_method.consensus import (  # noqa: E402
    NO_CAP,
    Group,
    confident_path,
    in_waves,
    outcomes,
)
from tests.test_consensus import K, repeated_draws, synthetic_groups  # noqa: E402


def test_rolling_launches_the_next_sample_when_a_running_one_finishes():
    """Two at a time: samples 0 and 1 at 0; sample 0 ends at 10, so 2 starts then (ends 15);
    3 starts at 15 (ends 35); 1 ends at 30, so 4 starts then. One at a time is waves of one,
    k at a time all at once."""
    lengths = np.array([10.0, 30, 5, 20, 8])
    start, finish = rolling(lengths, 2)
    assert start.tolist() == [0, 0, 10, 15, 30] and finish.tolist() == [10, 30, 15, 35, 38]
    ones = in_waves(lengths, (1,) * 5)
    assert all(np.array_equal(x, y) for x, y in zip(rolling(lengths, 1), ones))
    assert np.array_equal(rolling(lengths, 5)[0], np.zeros(5))


def test_the_stricter_first_pair_takes_its_stops_from_the_strict_groups():
    strict = Group(finish=np.array([50.0, 60, 70, 80]), answers=("a", "a", "a", "a"),
                   weights=np.ones(4), reference="a", stop_tokens=np.array([50.0, 60, 70, 80]))
    rest = Group(finish=np.array([5.0, 6, 7, 8]), answers=("b", "b", "c", "c"),
                 weights=np.ones(4), reference="a", stop_tokens=np.array([5.0, np.inf, 7, 8]))
    (g,) = stricter_first([strict], [rest], 2)
    assert g.finish.tolist() == [50, 60, 7, 8] and g.answers == ("a", "a", "c", "c")
    assert g.stop_tokens.tolist() == [50, 60, 7, 8] and g.reference == "a"


def test_agreement_weights_are_smoothed_shares_per_band_of_stop_tokens():
    """Two groups: in the 0-500 band 3 of 3 stopped answers agree with maj@k, weight (3 + 1) /
    (3 + 2); in 500-1,000, 0 of 1: 1/3; the samples that ran to their end, 1 of 2: 1/2; a band
    nobody fell in: 1/2. Every weight is in [0, 1], as the margin rule needs."""
    g1 = Group(finish=np.ones(3), answers=("a", "a", "b"), weights=np.ones(3), reference="a",
               stop_tokens=np.array([100.0, 200, 700]))
    g2 = Group(finish=np.ones(3), answers=("c", "c", "d"), weights=np.ones(3), reference="c",
               stop_tokens=np.array([499.0, np.inf, np.inf]))
    w = agreement_weights([g1, g2])(np.array([0.0, 500, 999, 1200, np.inf]))
    assert np.allclose(w, [4 / 5, 1 / 3, 1 / 3, 1 / 2, 1 / 2])


def test_the_launch_is_chosen_on_another_fold_and_certified_on_the_rest():
    """Every candidate errs nowhere except one cheap candidate that errs on every group of fold
    0 only. Fold 4 chooses for test fold 3 and picks the cheap one (its guess sees no error);
    the certifying folds 0-2 include fold 0's errors, so LTT certifies nothing there and fold
    3 runs to maj@k. Fold 0 is chosen for by fold 1 (no error seen: cheap), certified on folds
    2-4 (no error), so fold 0 gets the cheap rule and its errors."""
    H, n = 3, 500
    folds = np.arange(n) % 5
    dear = (np.zeros((H, n), bool), np.ones((H, n), bool), np.full((H, n), 50.0))
    cheap_err = np.zeros((H, n), bool)
    cheap_err[:, folds == 0] = True
    cheap = (cheap_err, ~cheap_err, np.full((H, n), 10.0))
    tabs = {c: dear for c in CANDIDATES}
    tabs[CANDIDATES[7]] = cheap
    full, maj_ok = np.full(n, 99.0), np.ones(n, bool)
    served, picks = chosen_fit(tabs, full, maj_ok, folds, 0.1)
    assert picks[3] == picks[0] == CANDIDATES[7].name
    assert served.rules[3] == -1 and np.all(served.tokens[folds == 3] == 99.0)
    assert served.rules[0] == H - 1 and served.err[folds == 0].all()
    assert np.all(served.tokens[folds == 0] == 10.0)


def test_ltt_over_a_rolling_launch_keeps_its_risk_within_delta_vote():
    """The clause's path (`confident_path`) over groups launched two at a time: a pool of
    20,000 synthetic groups (tests/test_consensus.py's), so each hypothesis's risk is exact;
    400 draws of 300 (seed 35); the certified (t, c)'s pool risk <= delta_vote in
    >= 1 - epsilon - 0.035 of the draws (3 Monte-Carlo standard errors). Not vacuous: the
    launch changes when groups settle, the risk crosses delta_vote along the path, and the
    certified rule uses the clause in most draws."""
    rng = np.random.default_rng(35)
    t, c = confident_path(K, cap_max=2000)
    base = synthetic_groups(20_000, rng, agree=0.6)
    pool = Candidate("any", None, True, rolling=2).launch(base)
    loss, tokens = outcomes(pool, t, c)  # [H, N]
    risk = loss.mean(axis=1)
    assert not np.allclose(tokens, outcomes(base, t, c)[1])  # the launch matters
    delta, epsilon = 0.1, 0.05
    on_caps = c > NO_CAP
    assert risk[~on_caps].max() < delta < risk[on_caps].max()
    within, lasts = repeated_draws(loss, delta, epsilon, rng)
    assert within >= 1 - epsilon - 0.035
    assert np.mean((lasts >= 0) & on_caps[lasts]) > 0.5
