"""benchmarks/bench_replay_shift.py: the gate, the give-up and the errors on hand-made traces,
and the replay's wiring on the shipped long bundle (fast, no engine)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_replay_shift import (  # noqa: E402
    BUNDLE,
    Replayed,
    arm_figures,
    clustered_ci,
    family_report,
    replay_family,
    savings_lost,
    alarm_lags,
    served_ends,
    served_flagged,
    stream_alarm,
)
from bench_samples import Trace  # noqa: E402
from orca_serve.settings.contract import ShiftAction  # noqa: E402

from orca_method.bundle import load_bundle  # noqa: E402
from orca_method.outcomes import Ended, GiveUpPolicy  # noqa: E402
from orca_method.trajectories import TrajectorySet, TrajectoryWriter  # noqa: E402


def replayed(stop: list[list[float]], give_up: list[list[float]], sup: list[list[int]],
             answers: list[list[str]], final: list[str], truth: list[str]) -> Replayed:
    traces = [Trace(cum=np.cumsum([10] * len(a)), step_answers=a, final=f,
                    completion=10 * len(a) + 5) for a, f in zip(answers, final)]
    return Replayed(stop=[np.array(s) for s in stop], give_up=[np.array(g) for g in give_up],
                    gate_score=np.zeros(len(stop)), traces=traces, truth=truth,
                    supervised=[np.array(c) for c in sup],
                    certified=[np.maximum.accumulate(np.array(c)) for c in sup])


def test_the_gate_holds_its_first_steps_and_a_flagged_request_runs_in_full():
    rep = replayed(stop=[[0.9] * 4, [0.9] * 4], give_up=[[0.5] * 4] * 2, sup=[[1] * 4] * 2,
                   answers=[["1"] * 4] * 2, final=["1", "1"], truth=["1", "1"])
    flagged = np.array([False, True])
    end, ended = served_ends(rep.stop, rep.give_up, 0.5, None, flagged, gate_steps=2)
    # the first request crosses at step 0 but the gate decides at step 1: it stops there
    assert end.tolist() == [1, 3] and ended == [Ended.EARLY, Ended.FULL]
    end, ended = served_ends(rep.stop, rep.give_up, 0.5, None, flagged, gate_steps=1)
    assert end.tolist() == [0, 3]


def test_under_strict_a_flagged_request_stops_at_the_safe_threshold_and_never_gives_up():
    rep = replayed(stop=[[0.6, 0.7, 0.8, 0.95]] * 2, give_up=[[0.0] * 4] * 2,
                   sup=[[1] * 4] * 2, answers=[["1"] * 4] * 2, final=["1", "1"],
                   truth=["1", "1"])
    flagged = np.array([False, True])
    for mu in (None, 0.05):  # the unflagged one gives up at once when two-sided; not the other
        end, ended = served_ends(rep.stop, rep.give_up, 0.5, mu, flagged, gate_steps=1, safe=0.9)
        assert end[1] == 3 and ended[1] == Ended.FULL  # 0.95 at the last step: no early stop
        end, ended = served_ends(rep.stop, rep.give_up, 0.5, mu, flagged, gate_steps=1, safe=0.75)
        assert end[1] == 2 and ended[1] == Ended.EARLY
    end, _ = served_ends(rep.stop, rep.give_up, 0.5, None, flagged, gate_steps=1, safe=0.75)
    assert end[0] == 0  # the unflagged request keeps the served lambda


def test_a_flagged_request_never_gives_up_and_the_stop_wins_a_tie():
    low = [0.1, 0.1, 0.1, 0.1]
    rep = replayed(stop=[low, low, [0.1, 0.9, 0.9, 0.9]], give_up=[[0.0] * 4] * 3,
                   sup=[[0, 0, 1, 1]] * 3, answers=[["2", "2", "1", "1"]] * 3,
                   final=["1"] * 3, truth=["1"] * 3)
    end, ended = served_ends(rep.stop, rep.give_up, 0.5, 0.05, np.array([False, True, False]),
                             gate_steps=2)
    assert end.tolist() == [1, 3, 1]
    assert ended == [Ended.GAVE_UP, Ended.FULL, Ended.EARLY]
    fig = arm_figures(rep, end, ended, np.array([False, True, False]), GiveUpPolicy.GUESS, True)
    # the early stop at step 1 is wrong (right only from step 2); the give-up lost a right answer
    assert fig["stop_error"]["k"] == 1 and fig["stop_error"]["n"] == 3
    assert fig["give_up_error"]["k"] == 1
    assert fig["accuracy"] == pytest.approx(1 / 3)  # only the flagged one, run in full
    # reasoning through the end step plus the trace's 5 answer tokens
    assert fig["tokens"] == pytest.approx((25 + 45 + 25) / 3)
    assert fig["flagged"]["k"] == 1


def test_never_right_requests_are_left_out_of_the_stop_error_as_calibrated():
    rep = replayed(stop=[[0.9] * 3, [0.9] * 3], give_up=[[0.5] * 3] * 2,
                   sup=[[0, 0, 0], [0, 1, 1]], answers=[["2"] * 3, ["2", "1", "1"]],
                   final=["2", "1"], truth=["1", "1"])
    end, ended = served_ends(rep.stop, rep.give_up, 0.5, None, np.zeros(2, dtype=bool),
                             gate_steps=1)
    fig = arm_figures(rep, end, ended, np.zeros(2, dtype=bool), GiveUpPolicy.GUESS, True)
    assert fig["stop_error"]["n"] == 1 and fig["stop_error"]["k"] == 1
    fig = arm_figures(rep, end, ended, np.zeros(2, dtype=bool), GiveUpPolicy.GUESS, False)
    assert fig["stop_error"]["n"] == 2 and fig["stop_error"]["k"] == 2


def test_a_stream_alarm_adds_to_the_gates_flags():
    flags = np.array([False, True, False, False])
    assert served_flagged(flags).tolist() == flags.tolist()
    after_first = lambda f: np.arange(len(f)) > int(np.argmax(f))  # noqa: E731
    assert served_flagged(flags, after_first).tolist() == [False, True, True, True]


def test_the_replay_runs_the_shipped_bundle_on_recorded_traces(tmp_path):
    """Random 256-dim embeddings through the long bundle's probe, give-up probe and gate: every
    arm's figures come out, in range, with a row per delta of the bundle."""
    bundle = load_bundle(BUNDLE)
    rng = np.random.default_rng(0)
    with TrajectoryWriter(tmp_path / "t", dim=256) as w:
        for i in range(12):
            n = int(rng.integers(2, 9))
            answers = [str(rng.integers(0, 3)) for _ in range(n)]
            w.append({"id": f"p{i}", "answer": "1", "step_tokens": [20] * n,
                      "step_answers": answers, "final_answer": answers[-1],
                      "labels": {"supervised": [int(a == "1") for a in answers],
                                 "consistent": [int(a == answers[-1]) for a in answers]},
                      "extra": {"completion_tokens": 20 * n + 6}},
                     rng.standard_normal((n, 256)).astype(np.float32))
    rep = family_report(bundle, replay_family(bundle, TrajectorySet.open(tmp_path / "t")))
    assert [p["delta"] for p in rep["orca"]] == bundle.deltas()
    for p in rep["orca"]:
        for arm in ("one-sided", "two-sided", "one-sided, no gate"):
            assert 0 <= p[arm]["accuracy"] <= 1 and p[arm]["stop_error"]["n"] <= 12
    assert len(rep["budget"]) > 0 and rep["gate"]["flagged"]["n"] == 12


@pytest.mark.parametrize("lag", [0, 5])
def test_the_replayed_alarm_serves_a_request_knowing_the_decisions_before_its_lag(lag):
    lags = np.full(60, lag)
    alarm = stream_alarm(n_cal=300, alpha=0.05, level=0.01, lag=lags)
    raised = alarm(np.ones(60, dtype=bool))  # every request flagged: the alarm must rise
    first = int(np.argmax(raised))
    assert raised.any() and raised[first:].all()
    assert first > lag  # nothing was heard before the first decision
    # the same decisions heard `lag` requests later: the same alarm, shifted
    assert first - lag == int(np.argmax(stream_alarm(300, 0.05, 0.01, np.zeros(60))(
        np.ones(60, dtype=bool))))
    assert not alarm(np.zeros(60, dtype=bool)).any()  # nothing flagged: never raised


def test_the_engine_hears_a_decision_at_the_gate_step_the_server_at_the_end():
    """At the gate step only the requests that arrived while this one reached its gate are
    not heard (a trace of 4 steps of 10 tokens + 5 answer tokens: 45 tokens; gate step 2: 21
    tokens); when requests finish, all `in_flight` of them."""
    rep = replayed(stop=[[0.5] * 4] * 3, give_up=[[0.5] * 4] * 3, sup=[[1] * 4] * 3,
                   answers=[["1"] * 4] * 3, final=["1"] * 3, truth=["1"] * 3)
    assert alarm_lags(rep, 32, 2, "finish").tolist() == [32] * 3
    assert alarm_lags(rep, 32, 2, "gate").tolist() == [15] * 3  # ceil(32 x 21 / 45)
    assert alarm_lags(rep, 0, 2, "gate").tolist() == [0] * 3


def test_savings_lost_are_the_flagged_requests_and_strict_keeps_what_its_lambda_allows():
    """Two requests whose stop score crosses every lambda* of the long bundle at step 1 (0-based,
    its gate step): the flagged one loses its savings under `full` (30 of the 110 tokens full
    reasoning spends on both) and none under `strict` (the largest lambda* stops it there too)."""
    bundle = load_bundle(BUNDLE)
    rep = replayed(stop=[[0.0, 0.95, 0.95, 0.95, 0.95]] * 2, give_up=[[1.0] * 5] * 2,
                   sup=[[0, 1, 1, 1, 1]] * 2, answers=[["0", "1", "1", "1", "1"]] * 2,
                   final=["1", "1"], truth=["1", "1"])
    rep.gate_score = np.array([np.inf, np.nan])  # the first flagged, the second never gated
    rep.prompt = ["a", "b"]
    full = savings_lost(bundle, rep, ShiftAction.FULL)
    assert full["flagged"] == 0.5 and full["prompts"] == 2
    assert [r["lost_points"] for r in full["rows"]] == pytest.approx([100 * 30 / 110] * 4)
    strict = savings_lost(bundle, rep, ShiftAction.STRICT)
    assert [r["lost_points"] for r in strict["rows"]] == [0.0] * 4


def test_the_clustered_interval_resamples_prompts_not_samples():
    """Eight samples of each of 20 prompts, every prompt's samples alike: resampled by prompt the
    interval is that of 20 draws, twice as wide as resampling 160 independent ones would give."""
    rng = np.random.default_rng(1)
    per_prompt = (rng.uniform(size=20) < 0.3).astype(float)  # [20]
    num, prompts = np.repeat(per_prompt, 8), [str(i) for i in np.repeat(np.arange(20), 8)]
    lo, hi = clustered_ci(num, np.ones(160), prompts)
    lo1, hi1 = clustered_ci(num, np.ones(160), [str(i) for i in range(160)])
    assert lo <= num.mean() <= hi and hi - lo > 2 * (hi1 - lo1)
    assert clustered_ci(num, np.ones(160), ["one"] * 160) == (num.mean(), num.mean())


def test_a_give_up_level_of_its_own_blocks_the_give_up_only():
    """`no_give_up` (the give-up side's own gate level): the request in it neither gives up nor
    is served the safe threshold; the stop side still runs lambda."""
    rep = replayed(stop=[[0.0, 0.1, 0.1, 0.95, 0.95]] * 2, give_up=[[1.0, 0.0, 0.0, 0.0, 0.0]] * 2,
                   sup=[[0, 0, 0, 1, 1]] * 2, answers=[["0", "0", "0", "1", "1"]] * 2,
                   final=["1", "1"], truth=["1", "1"])
    none = np.zeros(2, dtype=bool)
    end, ended = served_ends(rep.stop, rep.give_up, 0.5, 0.05, none, gate_steps=1, safe=0.9,
                             no_give_up=np.array([True, False]))
    assert [str(e) for e in ended] == ["early", "gave_up"] and end.tolist() == [3, 1]
