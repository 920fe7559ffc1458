"""The goodput benchmark's pure parts (benchmarks/bench_goodput.py), without a server: the oracle
stop on a labelled trace, the stop loss, the per-round figures and their on/off ratios."""

from __future__ import annotations

import math

import pytest

from benchmarks.bench_goodput import (
    arm_figures,
    first_index,
    interval95,
    oracle,
    request_loss,
    round_ratios,
    spread,
    stop_error,
    summarize,
    table,
)
from orca_method.answer_probes import trajectory_fields


def trace(step_answers: list[str], reference: str, step_tokens: list[int]) -> dict:
    """A labelled record as the benchmark builds it (collect's `trajectory_fields`); the final
    answer is the last step's (the text has no answer after the reasoning)."""
    return trajectory_fields("p", {"messages": [], "answer": reference}, text="",
                             finish_reason="stop", completion_tokens=sum(step_tokens),
                             step_tokens=step_tokens, probed=dict(enumerate(step_answers)))


def test_oracle_stops_at_the_first_step_with_the_final_answer() -> None:
    t = trace(["3", "4", "5", "5", "5"], "5", [30, 31, 32, 20, 21])
    o = oracle(t, completion_tokens=140)  # 134 in steps + 6 after the reasoning
    assert (o.step, o.tokens) == (2, 140 - 20 - 21)


def test_oracle_stops_at_the_final_answer_even_when_a_step_was_right() -> None:
    # final answer 6 (wrong): the first step that already says 6 is step 1, not step 2 ("5")
    t = trace(["4", "6", "5", "6"], "5", [10, 10, 10, 10])
    o = oracle(t, completion_tokens=45)
    assert (o.step, o.tokens) == (1, 25)


def test_oracle_without_any_step_matching_runs_to_the_end() -> None:
    t = trace(["1", "2"], "3", [10, 12])
    t["final_answer"], t["labels"]["consistent"] = "9", [0, 0]  # an answer no step gave
    o = oracle(t, completion_tokens=30)
    assert (o.step, o.tokens) == (1, 30)


def test_first_index() -> None:
    assert first_index([0, 0, 1, 0, 1]) == 2
    assert first_index([0, 0, 0]) == 2


@pytest.mark.parametrize(("answers", "orca", "loss"), [
    (["3", "5", "5"], {"stopped_early": True, "stop_step": 1}, 1),  # stopped before right
    (["3", "5", "5"], {"stopped_early": True, "stop_step": 2}, 0),  # stopped once right
    (["5", "4", "4"], {"stopped_early": True, "stop_step": 2}, 0),  # right once counts as right
    (["3", "5", "5"], {"stopped_early": False, "stop_step": None}, 0),  # ran to the end, right
    (["3", "4", "4"], {"stopped_early": False, "stop_step": None}, None),  # never right: excluded
    (["3", "4", "4"], {"stopped_early": True, "stop_step": 2}, None),  # stopped, never right
])
def test_request_loss_is_the_bundles_loss(answers: list[str], orca: dict, loss: int | None) -> None:
    # `answers`: the never-stopping trajectory's forced answers, reference "5"
    assert request_loss(trace(answers, "5", [10] * len(answers)), orca, True) == loss


def test_a_never_right_request_counts_when_the_bundle_kept_them() -> None:
    t = trace(["3", "4", "4"], "5", [10, 10, 10])
    assert request_loss(t, {"stopped_early": True, "stop_step": 2}, False) == 1


def test_stop_error_skips_excluded_requests() -> None:
    err, counted = stop_error([{"loss": 1}, {"loss": 0}, {"loss": None}, {"loss": 0}])
    assert counted == 3
    assert err == pytest.approx(1 / 3)
    assert math.isnan(stop_error([{"loss": None}])[0])


def test_interval95_covers_the_rate() -> None:
    low, high = interval95(0.05, 400)
    assert low < 0.05 < high
    assert (low, high) == pytest.approx((0.0311, 0.0758), abs=1e-3)


def test_arm_figures() -> None:
    reqs = [{"latency_s": float(i), "completion_tokens": 10 * i, "correct": i % 2 == 0}
            for i in range(1, 21)]
    f = arm_figures(reqs, wall_s=4.0)
    assert f["requests_per_s"] == 5.0
    assert f["tokens_per_request"] == 105.0
    assert f["p50_latency_s"] == pytest.approx(10.5)
    assert f["p95_latency_s"] == pytest.approx(19.05)  # numpy's linear interpolation
    assert f["accuracy"] == 0.5


def test_ratios_and_spread() -> None:
    rounds = [{"off": {"x": 2.0}, "on": {"x": 3.0}}, {"off": {"x": 4.0}, "on": {"x": 2.0}},
              {"off": {"x": 1.0}, "on": {"x": 2.0}}]
    r = round_ratios(rounds, "x")
    assert r == [1.5, 0.5, 2.0]
    assert spread(r) == {"min": 0.5, "median": 1.5, "max": 2.0}


def _response(answers: list[str], orca: dict, *, wall_tokens: int, correct: bool) -> dict:
    return {"latency_s": 1.0, "completion_tokens": wall_tokens, "correct": correct,
            "orca": orca, "trace": trace(answers, "5", [10] * len(answers))}


def test_summarize_and_table_from_recorded_rounds() -> None:
    off = [_response(["3", "5", "5", "5"], {}, wall_tokens=45, correct=True),
           _response(["4", "4", "4", "4"], {}, wall_tokens=45, correct=False)]
    on = [_response(["3", "5", "5"], {"stopped_early": True, "stop_step": 1},
                    wall_tokens=15, correct=False),
          _response(["4", "4"], {"stopped_early": True, "stop_step": 1},
                    wall_tokens=15, correct=False)]
    rnd = {"off": {"wall_s": 2.0, "requests": off}, "on": {"wall_s": 1.0, "requests": on}}
    (lv,) = summarize([{"concurrency": 4, "rounds": [rnd, rnd]}], True)
    assert lv["ratio"]["requests_per_s"] == {"min": 2.0, "median": 2.0, "max": 2.0}
    assert lv["ratio"]["tokens_per_request"]["median"] == pytest.approx(15 / 45)
    p = lv["pooled"]
    # oracle: step 1 (tokens 45 - 20) for the first, step 0 (45 - 30) for the second
    assert p["tokens_per_request"] == {"off": 45.0, "on": 15.0, "oracle": 20.0}
    assert p["accuracy"] == {"off": 0.5, "on": 0.0, "oracle": 0.5}
    assert p["mean_stop_step"] == {"on": 1.0, "oracle": 1.5}
    # the first stopped before its "5": loss 1; the second was never right: not counted
    assert (p["stop_error"], p["stop_error_counted"]) == (1.0, 2)
    assert p["stop_error_ci95"] == pytest.approx((0.158, 1.0), abs=1e-3)  # Clopper-Pearson 2/2
    assert "| 4 | 2 x 2 | 2.00 (2.00-2.00) |" in table([lv])
