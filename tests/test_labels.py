"""Answer extraction, equivalence and pessimistic label filling (docs/METHOD.md section 4)."""

import sys

import pytest

from orca_method.labels import (
    equivalent,
    extract_boxed,
    extract_final,
    extract_forced,
    fill_pessimistic,
    labelled_steps,
    step_labels,
)


def test_extraction() -> None:
    assert extract_boxed(r"so \boxed{3} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{unclosed") is None
    assert extract_forced("7}. done") == "7"
    assert extract_forced("12\nmore") == "12"
    assert extract_final("blah\nThe answer is 5") == "The answer is 5"


def test_equivalence() -> None:
    assert equivalent("7", " 7 ")
    assert equivalent(r"\frac{1}{2}", "0.5")
    assert not equivalent("8", "7")
    assert not equivalent(None, "7")


def test_label_every_is_pessimistic() -> None:
    assert labelled_steps(7, 3) == [2, 5, 6]
    assert labelled_steps(6, 3) == [2, 5]
    answers = fill_pessimistic({2: "4", 5: "7", 6: "7"}, 7)
    # steps 0-1 have no probed answer yet: never borrowed from the future
    assert answers == [None, None, "4", "4", "4", "7", "7"]
    assert step_labels(answers, "7") == [0, 0, 0, 0, 0, 1, 1]


def test_missing_math_verify_is_a_clear_error_not_exact_match_only(monkeypatch) -> None:
    """Without math-verify every supervised label would silently fall back to exact match."""
    from orca_method.labels import require_math_verify

    monkeypatch.setitem(sys.modules, "math_verify", None)  # import now raises ImportError
    equivalent.cache_clear()
    with pytest.raises(ValueError, match=r"pip install math-verify \(in this project's "
                                         r"checkout: pip install -e '\.\[calib\]'\)"):
        require_math_verify()
    with pytest.raises(ImportError):
        equivalent("1/2", "0.5")
    equivalent.cache_clear()
