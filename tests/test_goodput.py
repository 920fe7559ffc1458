"""The goodput benchmark's pure parts (benchmarks/bench_goodput.py), without a server: the oracles
on a labelled trace, the stop and give-up losses, the outcomes, the per-round figures and their
ratios to off."""

from __future__ import annotations

import math
from dataclasses import astuple

import pytest

from benchmarks.bench_goodput import (
    ARMS,
    arm_figures,
    arm_order,
    cut_step,
    first_index,
    give_up_loss,
    interval95,
    oracle,
    orca_body,
    outcomes,
    realized,
    request_loss,
    right_step_oracle,
    round_ratios,
    spread,
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


def test_a_realized_risk_skips_requests_not_counted() -> None:
    r = realized([1, 0, None, 0])
    assert (r["k"], r["n"]) == (1, 3)
    assert r["rate"] == pytest.approx(1 / 3)
    assert r["ci95"] == pytest.approx(interval95(1 / 3, 3))
    none = realized([None])
    assert math.isnan(none["rate"]) and none["n"] == 0 and none["ci95"] is None


def test_interval95_covers_the_rate() -> None:
    low, high = interval95(0.05, 400)
    assert low < 0.05 < high
    assert (low, high) == pytest.approx((0.0311, 0.0758), abs=1e-3)


def test_arm_figures() -> None:
    reqs = [{"latency_s": float(i), "completion_tokens": 10 * i, "correct": i % 2 == 0}
            for i in range(1, 21)]
    f = arm_figures(reqs, wall_s=4.0)
    assert f["requests_per_s"] == 5.0
    assert f["goodput"] == 2.5  # 10 right answers in 4 s
    assert f["tokens_per_request"] == 105.0
    assert f["p50_latency_s"] == pytest.approx(10.5)
    assert f["p95_latency_s"] == pytest.approx(19.05)  # numpy's linear interpolation
    assert f["accuracy"] == 0.5


def test_ratios_and_spread() -> None:
    rounds = [{"off": {"x": 2.0}, "on": {"x": 3.0}, "two_sided": {"x": 1.0}},
              {"off": {"x": 4.0}, "on": {"x": 2.0}, "two_sided": {"x": 2.0}},
              {"off": {"x": 1.0}, "on": {"x": 2.0}, "two_sided": {"x": 4.0}}]
    r = round_ratios(rounds, "x")
    assert r == [1.5, 0.5, 2.0]
    assert spread(r) == {"min": 0.5, "median": 1.5, "max": 2.0}
    assert round_ratios(rounds, "x", "two_sided") == [0.5, 0.5, 4.0]


def test_every_arm_runs_first_middle_and_last_equally_often() -> None:
    orders = [arm_order(i) for i in range(6)]
    assert orders[0] == list(ARMS)
    for position in range(len(ARMS)):
        assert sorted(o[position] for o in orders) == sorted(ARMS * 2)
    assert [arm_order(i, ("off", "on")) for i in range(2)] == [["off", "on"], ["on", "off"]]


def test_orca_bodies() -> None:
    assert orca_body("off", 0.1, 0.05) == {"enabled": False}
    assert orca_body("on", 0.1, 0.05) == {"enabled": True, "delta": 0.1}
    assert orca_body("two_sided", 0.1, 0.05) == {"enabled": True, "delta": 0.1,
                                                 "give_up": {"delta": 0.05}}


@pytest.mark.parametrize(("orca", "step"), [
    ({"stopped_early": True, "stop_step": 2, "ended": "early"}, 2),
    ({"stopped_early": False, "stop_step": None, "ended": "gave_up", "give_up_step": 3}, 3),
    ({"stopped_early": False, "stop_step": None, "ended": "full", "give_up_step": None}, None),
    ({}, None),  # ORCA off
])
def test_cut_step(orca: dict, step: int | None) -> None:
    assert cut_step(orca) == step


@pytest.mark.parametrize(("answers", "ended", "step", "loss"), [
    (["3", "4", "5"], "gave_up", 2, 1),  # gave up on a trajectory that gets right later
    (["5", "4", "4"], "gave_up", 2, 0),  # right only before the give-up: nothing lost
    (["5", "4", "4"], "gave_up", 1, 1),  # gave up at the right step itself
    (["3", "4", "4"], "gave_up", 1, 0),  # never right: giving up cost nothing
    (["3", "4", "5"], "early", None, 0),  # a stop is the stop error's business
    (["3", "4", "5"], "full", None, 0),
])
def test_give_up_loss(answers: list[str], ended: str, step: int | None, loss: int) -> None:
    t = trace(answers, "5", [10] * len(answers))
    assert give_up_loss(t, {"ended": ended, "give_up_step": step}, "supervised") == loss


def test_a_given_up_request_has_no_stop_loss() -> None:
    # it did not stop early: scored at its last step, which the trajectory reached right
    t = trace(["3", "4", "5"], "5", [10, 10, 10])
    orca = {"stopped_early": False, "stop_step": None, "ended": "gave_up", "give_up_step": 1}
    assert request_loss(t, orca, True) == 0


def test_right_step_oracles() -> None:
    right = trace(["3", "5", "4", "4"], "5", [10, 11, 12, 13])  # right at step 1, ends wrong
    never = trace(["3", "4", "4"], "5", [10, 11, 12])
    # 5 tokens of answer after the reasoning in each; (tokens, correct, gave_up)
    assert astuple(right_step_oracle(right, 51, False, give_up=False)) == (51 - 25, True, False)
    assert astuple(right_step_oracle(right, 51, False, give_up=True)) == (51 - 25, True, False)
    assert astuple(right_step_oracle(never, 38, False, give_up=False)) == (38, False, False)
    assert astuple(right_step_oracle(never, 38, False, give_up=True)) == (38 - 23, False, True)
    # the checker may accept a text no forced answer had: running to the end delivers it
    assert right_step_oracle(never, 38, True, give_up=False).correct


def test_outcomes_per_way_the_reasoning_ended() -> None:
    reqs = [{"orca": {"ended": "early"}, "completion_tokens": 10, "correct": True},
            {"orca": {"ended": "early"}, "completion_tokens": 20, "correct": False},
            {"orca": {"ended": "gave_up"}, "completion_tokens": 5, "correct": False},
            {"orca": {}, "completion_tokens": 40, "correct": True}]  # ORCA off: full
    o = outcomes(reqs)
    assert list(o) == ["early", "gave_up", "full"]
    assert o["early"] == {"n": 2, "share": 0.5, "tokens_per_request": 15.0, "accuracy": 0.5}
    assert o["gave_up"]["n"] == 1 and o["gave_up"]["accuracy"] == 0.0
    assert o["full"] == {"n": 1, "share": 0.25, "tokens_per_request": 40.0, "accuracy": 1.0}
    assert "gave_up" not in outcomes(reqs[:2])


def _response(answers: list[str], orca: dict, *, wall_tokens: int, correct: bool) -> dict:
    return {"latency_s": 1.0, "completion_tokens": wall_tokens, "correct": correct,
            "orca": orca, "trace": trace(answers, "5", [10] * len(answers))}


def test_summarize_and_table_from_recorded_rounds() -> None:
    off = [_response(["3", "5", "5", "5"], {}, wall_tokens=45, correct=True),
           _response(["4", "4", "4", "4"], {}, wall_tokens=45, correct=False)]
    on = [_response(["3", "5", "5"], {"stopped_early": True, "stop_step": 1, "ended": "early"},
                    wall_tokens=15, correct=False),
          _response(["4", "4"], {"stopped_early": True, "stop_step": 1, "ended": "early"},
                    wall_tokens=15, correct=False)]
    two = [_response(["3", "5", "5", "5"], {"stopped_early": False, "stop_step": None,
                                            "ended": "gave_up", "give_up_step": 1},
                     wall_tokens=15, correct=False),
           _response(["4", "4", "4", "4"], {"stopped_early": False, "stop_step": None,
                                            "ended": "gave_up", "give_up_step": 1},
                     wall_tokens=15, correct=False)]
    rnd = {"off": {"wall_s": 2.0, "requests": off}, "on": {"wall_s": 1.0, "requests": on},
           "two_sided": {"wall_s": 0.5, "requests": two}}
    (lv,) = summarize([{"family": "shifted", "concurrency": 4, "rounds": [rnd, rnd]}], True)
    assert lv["arms"] == ["off", "on", "two_sided"]
    assert lv["ratio"]["on"]["requests_per_s"] == {"min": 2.0, "median": 2.0, "max": 2.0}
    assert lv["ratio"]["on"]["tokens_per_request"]["median"] == pytest.approx(15 / 45)
    assert lv["ratio"]["two_sided"]["requests_per_s"]["median"] == 4.0
    assert lv["ratio"]["on"]["goodput"]["median"] == 0.0  # no right answer under ORCA
    p = lv["pooled"]
    # oracle: step 1 (tokens 45 - 20) for the first, step 0 (45 - 30) for the second
    assert {a: p[a]["tokens_per_request"] for a in ("off", "on", "oracle")} == {
        "off": 45.0, "on": 15.0, "oracle": 20.0}
    assert {a: p[a]["accuracy"] for a in ("off", "on", "oracle")} == {
        "off": 0.5, "on": 0.0, "oracle": 0.5}
    assert (p["on"]["mean_end_step"], p["oracle"]["mean_end_step"]) == (1.0, 1.5)
    # the supervised oracles: the first is right at step 1 (25 tokens); the second is never
    # right: runs to its end (45), or gives up after step 0 (15)
    assert p["oracle_stop"] == {"tokens_per_request": 35.0, "accuracy": 0.5, "gave_up": 0.0}
    assert p["oracle_two_sided"] == {"tokens_per_request": 20.0, "accuracy": 0.5, "gave_up": 0.5}
    assert p["off"]["goodput"] == 0.5  # 2 right answers in 4 s
    # the first stopped before its "5": loss 1; the second was never right: not counted
    assert (p["on"]["stop_error"]["rate"], p["on"]["stop_error"]["n"]) == (1.0, 2)
    assert p["on"]["stop_error"]["ci95"] == pytest.approx((0.158, 1.0), abs=1e-3)  # CP 2/2
    # two-sided: both gave up; the first would have ended right (give-up loss 1, and no stop
    # loss: it did not stop), the second never right (loss 0, counted: every request counts)
    assert (p["two_sided"]["stop_error"]["k"], p["two_sided"]["stop_error"]["n"]) == (0, 2)
    assert {k: p["two_sided"]["give_up_error"][k] for k in ("rate", "k", "n")} == {
        "rate": 0.5, "k": 2, "n": 4}
    assert p["two_sided"]["outcomes"] == {"gave_up": {"n": 4, "share": 1.0,
                                                      "tokens_per_request": 15.0,
                                                      "accuracy": 0.0}}
    text = table([lv])
    assert "| shifted | 4 | 2 x 2 | ORCA / off | 2.00 (2.00-2.00) |" in text
    assert "| 0.500 (2/4; " in text
    assert "| shifted | 4 | two-sided ORCA | gave_up | 4 (1.000) | 15.0 | 0.000 |" in text


def test_summarize_takes_the_arms_the_rounds_hold() -> None:
    off = [_response(["5", "5"], {}, wall_tokens=20, correct=True)]
    on = [_response(["5", "5"], {"stopped_early": True, "stop_step": 1, "ended": "early"},
                    wall_tokens=10, correct=True)]
    rnd = {"off": {"wall_s": 1.0, "requests": off}, "on": {"wall_s": 1.0, "requests": on}}
    (lv,) = summarize([{"family": "in-dist", "concurrency": 1, "rounds": [rnd]}], True)
    assert lv["arms"] == ["off", "on"] and "two_sided" not in lv["pooled"]
    assert "give_up_error" not in lv["pooled"]["on"]
