import math

import numpy as np
import pytest

from orca_method.risk import is_solvable
from orca_method.stop_metrics import (
    check_problems,
    losses,
    stop_indices,
    summarize,
    token_savings,
)


def naive_tau(m: np.ndarray, lam: float) -> int:
    for t, s in enumerate(m):
        if s >= lam:
            return t
    return len(m) - 1


def test_stop_indices_match_naive_loop_with_ties():
    rng = np.random.default_rng(0)
    # Scores and thresholds on the same 0.1 lattice, so m_t == lambda happens often.
    scores = [rng.integers(0, 11, size=rng.integers(1, 30)) / 10 for _ in range(200)]
    lambdas = np.concatenate((np.arange(11)[::-1] / 10, [0.55, 1.5, math.inf, -math.inf]))
    tau = stop_indices(scores, lambdas)
    assert tau.shape == (lambdas.size, len(scores))
    expected = [[naive_tau(m, lam) for m in scores] for lam in lambdas]
    np.testing.assert_array_equal(tau, expected)


def test_stop_indices_tie_stops_and_inf_never_stops():
    tau = stop_indices([np.array([0.2, 0.5, 0.5, 0.9])], np.array([0.5, math.inf, 0.95]))
    np.testing.assert_array_equal(tau[:, 0], [1, 3, 3])


def test_stop_indices_rejects_nan_threshold():
    with pytest.raises(ValueError, match="NaN"):
        stop_indices([np.array([0.5])], np.array([math.nan]))


def example():
    labels = [np.array([0, 0, 1, 1]), np.array([0, 1]), np.ones(5, dtype=int)]
    tokens = [np.array([10, 20, 30, 40]), np.array([5, 5]), np.ones(5, dtype=int)]
    tau = np.array([1, 1, 0])
    return tau, np.array([4, 2, 5]), labels, tokens


def test_summarize_hand_computed():
    tau, lengths, labels, tokens = example()  # steps run: 2 of 4, 2 of 2, 1 of 5
    out = summarize(tau, lengths, labels, tokens)
    # the paper's figure: mean over problems of 1 - tau/T
    assert out.savings_per_problem == pytest.approx((0.5 + 0.0 + 0.8) / 3)
    # ratio of means: 1 - (2 + 2 + 1) / (4 + 2 + 5); lower here, as the long problem stops late
    assert out.savings_total_steps == pytest.approx(1 - 5 / 11)
    assert out.median_savings_per_problem == pytest.approx(0.5)
    # tokens used: 30 of 100, 10 of 10, 1 of 5
    assert out.token_savings_per_problem == pytest.approx((0.7 + 0.0 + 0.8) / 3)
    assert out.token_savings_total == pytest.approx(1 - (30 + 10 + 1) / (100 + 10 + 5))
    assert out.error == pytest.approx(1 / 3)
    assert out.n == 3


def test_savings_definitions_agree_on_equal_lengths():
    labels = [np.ones(10, dtype=int)] * 3
    tau = np.array([0, 4, 9])
    out = summarize(tau, np.full(3, 10), labels)
    assert out.savings_per_problem == pytest.approx(out.savings_total_steps)
    assert out.savings_per_problem == pytest.approx(1 - (1 + 5 + 10) / 30)


def test_summarize_without_tokens_and_bad_tau():
    tau, lengths, labels, _ = example()
    out = summarize(tau, lengths, labels)
    assert out.token_savings_total is None and out.token_savings_per_problem is None
    with pytest.raises(ValueError, match="tau"):
        summarize(np.array([4, 1, 0]), lengths, labels)
    with pytest.raises(ValueError, match="lengths"):
        summarize(tau, np.array([4, 2, 6]), labels)


def test_losses_and_token_savings_vectorise_over_lambdas():
    tau, lengths, labels, tokens = example()
    many = np.stack([tau, lengths - 1])
    np.testing.assert_array_equal(losses(many, labels), [[1, 0, 0], [0, 0, 0]])
    np.testing.assert_allclose(token_savings(many, tokens), [1 - 41 / 115, 0.0])


def test_is_solvable():
    mask = [is_solvable(c) for c in [np.array([0, 0]), np.array([0, 1]), np.array([1])]]
    np.testing.assert_array_equal(mask, [False, True, True])


@pytest.mark.parametrize(
    "scores, labels, tokens, match",
    [
        ([], [], None, "empty"),
        ([np.array([0.1])], [], None, "label arrays"),
        ([np.array([0.1, 0.2])], [np.array([0])], None, "labels"),
        ([np.array([0.1])], [np.array([2])], None, "0/1"),
        ([np.array([1.5])], [np.array([1])], None, r"\[0, 1\]"),
        ([np.array([math.nan])], [np.array([1])], None, "finite"),
        ([np.array([0.1])], [np.array([1])], [np.array([1, 2])], "token counts"),
    ],
)
def test_check_problems_errors(scores, labels, tokens, match):
    with pytest.raises(ValueError, match=match):
        check_problems(scores, labels, tokens)
