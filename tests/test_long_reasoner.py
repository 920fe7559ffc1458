"""The long reasoner's task, its training examples, and the offline stopping rules of
benchmarks/bench_frontier.py (fast; the shipped model served: test_demo_long.py)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from statistics import mean, median, quantiles

import pytest

from orca_demo.long.tasks import (
    CHECKS,
    FAMILIES,
    make_problem,
    paragraph_candidate,
    trace,
    trace_paragraphs,
    trace_stats,
)
from orca_demo.long.train import LONG, make_example
from orca_demo.toy.train import EOS

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_frontier import (  # noqa: E402
    consistency_stop,
    offline_stop,
    probe_right,
    step_confidences,
    threshold_stop,
    tokens_for,
    versus,
)


@pytest.mark.parametrize("family", FAMILIES)
def test_written_traces_are_long_right_and_parse(family: str) -> None:
    """The traces the model is trained on: as long as the issue asks (median >= 40 steps, p90 >=
    120 in distribution), right, well-formed by the evaluation's own parser, with the answer first
    stated at the step whose sum equals C, followed by exactly CHECKS numbered checks and the
    conclusion: 20-50% of the steps on average (the hard family's walks are longer, so its share
    is lower)."""
    rng = random.Random(f"shape:{family}")
    lengths, redundant, depth = [], [], []
    for _ in range(600):
        p = make_problem(rng, family)
        assert p.a * p.x + p.b == p.c and p.x >= 0
        text = trace(p, rng)
        s = trace_stats(text, p)
        assert s.well_formed and s.correct, text
        paras = text.split("</think>")[0].split("\n\n")
        assert f"equals {p.c}." in paras[s.first_right]
        assert s.redundant == CHECKS + 1 and paras[-2].startswith(f"Check {CHECKS}, ")
        lengths.append(s.paragraphs)
        redundant.append(s.redundant / s.paragraphs)
        depth.append(s.first_right)
    if family != "hard":
        assert median(lengths) >= 40 and quantiles(lengths, n=10)[-1] >= 120
        q1, _, q3 = quantiles(depth, n=4)
        assert q3 >= 3 * q1  # the answer appears at widely varying depths
    assert (0.1 if family == "hard" else 0.2) <= mean(redundant) <= 0.5


def test_candidates_follow_the_walk_and_the_checks() -> None:
    assert paragraph_candidate("x=33: 305+8=313, below 377.") == 33
    assert paragraph_candidate("Wait, x=33: 305+8=313, not 314, below 377.") == 33
    assert paragraph_candidate("Check 1, x=40: 377-8=369, so x=41 holds.") == 41
    assert paragraph_candidate("So x=41.") == 41
    p = make_problem(random.Random(3), "shifted")
    assert p.start > p.x
    paras = trace_paragraphs(p, random.Random(4))
    assert [paragraph_candidate(s) for s in paras][-1] == p.x


def test_forced_examples_train_the_reasoning_and_the_answer_not_the_close() -> None:
    """A forced example keeps loss on its reasoning prefix and its answer, none on the suffix
    that closes the thinking (else the model learns to stop thinking early)."""
    from orca_demo.toy.train import build_tokenizer, encode

    tok = build_tokenizer(random.Random(0), n_texts=300, recipe=LONG)
    rng = random.Random(5)
    forced = [ex for ex in (make_example(rng) for _ in range(60)) if not ex[0].endswith(EOS)]
    assert 5 <= len(forced) <= 35
    for text, loss_from, skip in forced:
        assert skip is not None and text[skip[0]:skip[1]].endswith("\\boxed{")
        ids, weights = encode(tok, text, loss_from, skip, LONG.decision_re)
        enc = tok.encode(text)
        in_skip = [w for (a, _), w in zip(enc.offsets, weights) if skip[0] <= a < skip[1]]
        assert in_skip and all(w == 0 for w in in_skip)
        assert weights[-1] > 0 and sum(w > 0 for w in weights) > len(weights) // 3


def test_the_sign_of_each_step_weighs_like_a_decision() -> None:
    """Which way the walk goes is written once per step, as the sign of its sum; most walks down
    that failed went the wrong way at the first step, so the sign is weighted like the decision
    words (and a check's sign, the other way, too)."""
    from orca_demo.toy.train import DECISION_WEIGHT, build_tokenizer, encode

    tok = build_tokenizer(random.Random(0), n_texts=300, recipe=LONG)
    for text in ("x=37: 273-7=266, above 250.", "Check 1, x=37: 302-7=295, so x=38 holds.",
                 "x=38: 266+7=273, below 302."):
        enc = tok.encode(text)
        _, weights = encode(tok, text, 0, None, LONG.decision_re)
        sign_at = next(i for i, c in enumerate(text) if c in "+-")
        token = next(i for i, (a, b) in enumerate(enc.offsets) if a <= sign_at < b)
        assert weights[token] == DECISION_WEIGHT, (text, enc.tokens[token])
        total = text.index("=", sign_at)  # every digit of the sum, the last one included
        digits = [w for (a, _), w in zip(enc.offsets, weights) if total < a <= total + 3]
        assert digits == [DECISION_WEIGHT] * len(digits) and digits, (text, weights)
        assert min(weights) == 1.0  # and not everything is weighted


# ------------------------------------------------------------ bench_frontier's offline rules

def test_consistency_stops_at_k_agreeing_answers() -> None:
    answers = ["3", "4", "5", "5", None, "5", "5", "5"]
    assert consistency_stop(answers, 2) == 3
    assert consistency_stop(answers, 3) == 7
    assert consistency_stop(answers, 4) is None


def test_threshold_and_step_confidence() -> None:
    assert threshold_stop([0.1, 0.5, 0.9, 0.95], 0.9) == 2
    assert threshold_stop([0.1], 0.5) is None
    assert step_confidences([1.0, 3.0, 5.0, 7.0, 9.0], [2, 5]) == [2.0, 7.0]


def test_offline_stop_counts_tokens_through_the_step_plus_the_answer() -> None:
    trace_ = {"step_answers": ["1", "2", "7", "7"]}
    ends = [10, 20, 30, 40]  # the response: 40 reasoning tokens, then 8 answer tokens
    stop = offline_stop(trace_, ends, 48, 2, "7", full_correct=True)
    assert (stop.tokens, stop.correct) == (38, True)
    assert offline_stop(trace_, ends, 48, 0, "7", True).correct is False
    assert offline_stop(trace_, ends, 48, None, "7", False).tokens == 48


def test_the_probe_is_read_at_the_step_orca_ended_on() -> None:
    """Right then wrong: the stop step's own (raw) label counts, not whether an earlier step was
    right (that is the stop loss's cumulative rule)."""
    trace_ = {"labels": {"supervised": [0, 1, 0, 1]}}
    assert probe_right(trace_, {"stopped_early": True, "stop_step": 2}) is True
    assert probe_right(trace_, {"stopped_early": True, "stop_step": 3}) is False
    assert probe_right(trace_, {"ended": "gave_up", "give_up_step": 1}) is False
    assert probe_right(trace_, {}) is True  # ran to its end: the last step


def test_curves_compare_where_both_have_points() -> None:
    orca = [{"tokens": 100, "accuracy": 0.9}, {"tokens": 200, "accuracy": 0.95}]
    assert versus(orca, {"tokens": 150, "accuracy": 0.92}) == "above"
    assert versus(orca, {"tokens": 150, "accuracy": 0.94}) == "below"
    assert versus(orca, {"tokens": 50, "accuracy": 0.6}) == "outside"
    budget = [{"tokens": 100, "accuracy": 0.5}, {"tokens": 300, "accuracy": 0.9}]
    assert tokens_for(budget, 0.7) == pytest.approx(200)
    assert tokens_for(budget, 0.95) is None
