"""benchmarks/bench_samples.py's offline rules on hand-made traces (fast)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_samples import (  # noqa: E402
    Trace,
    adaptive_consistency,
    budget_answer,
    consensus_arm,
    esc,
    settled,
    sequential,
)

from orca_method.consensus import DEFAULT_CAP_MAX, Group, launched  # noqa: E402

# reasoning 30 + 40 + 50 = 120 tokens, then 10 answer tokens; probed answers per step
TRACE = Trace(cum=np.array([30, 70, 120]), step_answers=["1", "2", "3"], final="3",
              completion=130)


def test_the_budget_cuts_at_the_last_step_boundary_within_it():
    assert TRACE.answer_tokens == 10
    assert budget_answer(TRACE, 80) == ("2", 80.0)  # step 2 ends at 70, plus its answer
    assert budget_answer(TRACE, 120) == ("3", 130.0)  # within the budget: the full trace
    assert budget_answer(TRACE, 20) == (None, 30.0)  # no step fits: no answer


def full(answers: list[str]) -> list[Trace]:
    return [Trace(cum=np.array([100]), step_answers=[a], final=a, completion=100)
            for a in answers]


def test_sequential_rules_stop_where_their_criteria_say():
    group = full(["4", "4", "5", "4", "4", "4", "4", "4"])
    assert sequential(group, esc(2)) == ("4", 200.0)  # the first window agrees
    # no window agrees: all six vote, a three-way tie goes to sample 0
    assert sequential(full(["4", "5", "4", "6", "6", "5"]), esc(2)) == ("4", 600.0)
    # Beta(c1 + 1, c2 + 1) > 0.5 with probability >= 0.8: after 2 agreeing samples (0.875)
    assert sequential(group, adaptive_consistency(0.8)) == ("4", 200.0)
    # 0.95 with one disagreeing sample needs 6 against 1 (0.965; 5 against 1 gives 0.9375)
    assert sequential(group, adaptive_consistency(0.95)) == ("4", 700.0)


def test_consensus_arm_counts_tokens_until_the_group_settles():
    """Two samples finish at 50 agreeing, two at 200 disagreeing. At t = 0 the group settles at
    50: 4 x 50 reasoning tokens plus the 2 finished answers; with no t certified (a fold whose
    groups all disagree) it runs every sample to its end and answers maj@k."""
    traces = [Trace(cum=np.array([f]), step_answers=[a], final=a, completion=int(f) + 5)
              for f, a in [(50, "4"), (50, "4"), (200, "5"), (200, "6")]]
    g = Group(finish=np.array([50.0, 50, 200, 200]), answers=("4", "4", "5", "6"),
              weights=np.ones(4), reference="4")
    arm, ts = consensus_arm("x", [g] * 40, [traces] * 40, ["4"] * 40, np.arange(40) % 2, 0.2)
    assert ts == [(0.0, None), (0.0, None)] and arm.tokens[0] == 4 * 50 + 2 * 5
    assert arm.correct[0] and not any(arm.vote_error)
    # with the confidence clause its path goes down to first_t (0.34 for k = 4), up the caps,
    # then below first_t at the last cap: no pair errs here, so all of it is certified; the
    # group settles at 50 as before (sample 0, stopped early at 50 tokens, is confident too)
    sure = Group(finish=g.finish, answers=g.answers, weights=g.weights, reference="4",
                 stop_tokens=np.array([50.0, 50, np.inf, np.inf]))
    arm, ts = consensus_arm("y", [sure] * 40, [traces] * 40, ["4"] * 40, np.arange(40) % 2, 0.2,
                            confident=True)
    assert ts == [(0.0, DEFAULT_CAP_MAX)] * 2
    assert arm.tokens[0] == 4 * 50 + 2 * 5 and not any(arm.vote_error)
    # in waves 2+2 the group settles when the first wave ends: the second is never launched
    (w,) = launched([g], (2, 2))
    assert settled(w, traces, 0.0) == ("4", 2 * 50 + 2 * 5, 1, 50.0)


def test_collect_extends_the_prompts_along_their_stream_and_keeps_the_recorded_ones(tmp_path):
    from bench_samples import extend_prompts

    from orca_demo.long import tasks

    path = tmp_path / "prompts.jsonl"
    extend_prompts(path, lambda p: tasks.write_prompts(p, "in-dist", 3, 35))
    first = path.read_bytes()
    extend_prompts(path, lambda p: tasks.write_prompts(p, "in-dist", 5, 35))
    assert path.read_bytes().startswith(first) and path.read_bytes().count(b"\n") == 5
    extend_prompts(path, lambda p: tasks.write_prompts(p, "in-dist", 2, 35))  # fewer: kept
    assert path.read_bytes().count(b"\n") == 5
    # another stream does not start with the recorded prompts: refused, the file untouched
    before = path.read_bytes()
    with pytest.raises(SystemExit, match="no longer starts"):
        extend_prompts(path, lambda p: tasks.write_prompts(p, "in-dist", 8, 36))
    assert path.read_bytes() == before and not path.with_suffix(".new").exists()


def test_a_group_is_placed_by_its_prompt_number_not_its_sorted_id():
    """Groups come sorted by id ("-10" before "-2"): `report --n` and the holdout bench place
    them by the number in the id, so an extended recording's first 100 are the first recorded."""
    from types import SimpleNamespace

    from bench_samples import prompt_number

    ts = SimpleNamespace(problems=[SimpleNamespace(id=i) for i in
                                   ("long-in-dist-10#0", "long-in-dist-10#1", "long-in-dist-2#0")])
    assert prompt_number(ts, [0, 1]) == 10 and prompt_number(ts, [2]) == 2
