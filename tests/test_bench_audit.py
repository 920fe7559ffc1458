"""benchmarks/bench_audit.py's replay of one audit at a lambda, and its summary (fast)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_audit import at_lambda, summarize  # noqa: E402

# 3 steps: the score crosses 0.5 at step 2 (index 1), 0.9 at step 3; the answer agrees with the
# final one from step 3, and is the prompt's right answer from step 2 (the final answer is wrong)
SCORES, CONSISTENT, TOKENS, RIGHT = [0.1, 0.6, 0.9], [0, 0, 1], [5, 6, 7], [0, 1, 1]


@pytest.mark.parametrize(("lam", "expected"), [
    (0.5, {"loss": 1, "steps": 2, "tokens": 11, "right": True}),
    (0.9, {"loss": 0, "steps": 3, "tokens": 18, "right": True}),
    (0.95, {"loss": 0, "steps": 3, "tokens": 18, "right": True}),  # never crosses: the end
    (math.inf, {"loss": 0, "steps": 3, "tokens": 18, "right": True}),
    (0.05, {"loss": 1, "steps": 1, "tokens": 5, "right": False}),
])
def test_an_audit_stops_where_the_server_would(lam: float, expected: dict) -> None:
    """The stop is the first step whose score reaches lambda (the last if none), the loss is the
    consistency loss there, and the accuracy is the probed answer's at that same step."""
    assert at_lambda(SCORES, CONSISTENT, TOKENS, RIGHT, lam) == expected


def test_summary_of_audits() -> None:
    rows = []
    for lam, right_full in ((0.5, False), (math.inf, True)):
        r = at_lambda(SCORES, CONSISTENT, TOKENS, RIGHT, lam)
        rows.append({f"{k}_served": v for k, v in r.items()}
                    | {"steps": 3, "tokens": 18, "right_full": right_full})
    s = summarize(rows, "served")
    assert s == {"n": 2, "error": 0.5, "savings_total_steps": round(1 - 5 / 6, 4),
                 "token_savings_total": round(1 - 29 / 36, 4), "tokens": 14.5, "accuracy": 1.0,
                 "tokens_full": 18.0, "accuracy_full": 0.5}
    assert summarize([], "served") == {"n": 0}
