"""benchmarks/bench_shift.py's pure parts, without a server: the stream's segments, the arms'
request bodies, and the error and bad-lambda accounting of a segment (fast)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_shift import (  # noqa: E402
    MIXTURE,
    acting,
    against_budget,
    arm_batches,
    arm_body,
    build_stream,
    done_means,
    by_segment,
    first_reactions,
    gap_interval,
    mark_bad,
    prompts_needed,
    record,
    summarize,
    table,
)

FAMILIES = ("in-dist", "shifted", "hard")


def prompts(family: str, n: int) -> list[dict]:
    return [{"id": f"{family}-{i}", "family": family} for i in range(n)]


def test_the_stream_runs_its_segments_in_order_then_a_mixture_of_unused_prompts() -> None:
    sizes, n_mix = {"in-dist": 3, "shifted": 5, "hard": 2}, 7
    need = prompts_needed(FAMILIES, sizes, n_mix)
    assert need == {"in-dist": 6, "shifted": 7, "hard": 4}  # the mixture takes 3, 2, 2
    stream = build_stream({f: prompts(f, need[f]) for f in FAMILIES}, sizes, n_mix, seed=1)
    assert [p["i"] for p in stream] == list(range(len(stream)))
    assert [p["segment"] for p in stream] == (["in-dist"] * 3 + ["shifted"] * 5 + ["hard"] * 2
                                              + [MIXTURE] * 7)
    assert all(p["family"] == p["segment"] for p in stream[:10])
    assert len({p["id"] for p in stream}) == len(stream)  # no prompt twice
    mix = stream[10:]
    assert sorted(p["family"] for p in mix) == ["hard"] * 2 + ["in-dist"] * 3 + ["shifted"] * 2
    assert build_stream({f: prompts(f, need[f]) for f in FAMILIES}, sizes, n_mix, seed=1) == stream
    with pytest.raises(ValueError, match="more in-dist"):
        build_stream({f: prompts(f, sizes[f]) for f in FAMILIES}, sizes, n_mix, seed=1)


def test_each_arm_sends_its_defences() -> None:
    assert arm_body("full") == {"orca": {"enabled": False}}
    assert arm_body("budget@256") == {"orca": {"enabled": False}, "thinking_token_budget": 256}
    gated = arm_body("gated@0.1")["orca"]
    assert gated["delta"] == 0.1 and "shift_alpha" not in gated and "give_up" not in gated
    both = arm_body("two-sided-ungated@0.2")["orca"]
    assert both["shift_alpha"] == 0 and both["give_up"] == {"delta": 0.05}
    assert "shift_alpha" not in arm_body("two-sided@0.2")["orca"]
    with pytest.raises(ValueError):
        arm_body("nonsense@0.1")


@pytest.mark.parametrize(("orca", "acts"), [
    ({"enabled": True, "lambda": 0.4}, True),
    ({"enabled": True, "lambda": 0.4, "shift": {"flagged": True}}, False),
    ({"enabled": True, "lambda": 0.4, "shift": {"flagged": False}}, True),
    ({"enabled": True, "lambda": 0.4, "audited": True}, False),  # shadow: runs in full
    # the engine's gate alarm served it as flagged: the safe action, whatever it was resolved with
    ({"enabled": True, "lambda": 0.4, "shift": {"flagged": False}, "shift_alarm": True}, False),
    ({"enabled": True, "lambda": None, "lambda_source": "fallback"}, False),
    ({"enabled": False}, False),
])
def test_a_request_acts_only_with_a_lambda_that_could_stop_it(orca: dict, acts: bool) -> None:
    assert acting(orca) is acts


def rec(i: int, family: str, loss: int | None, *, flagged: bool = False, lam: float | None = 0.4,
        source: str = "bundle", give_up_loss: int = 0, correct: bool = True,
        segment: str | None = None, alarm: bool = False) -> dict:
    orca = {"enabled": True, "lambda": lam, "lambda_source": source,
            "shift": {"flagged": flagged}, **({"shift_alarm": True} if alarm else {})}
    return {"i": i, "id": f"{family}-{i}", "segment": segment or family, "family": family,
            "tokens": 100 + i, "correct": correct, "orca": True, "flagged": flagged,
            "alarm": alarm,
            "audited": False, "acting": acting(orca), "lambda": lam, "lambda_source": source,
            "gave_up": bool(give_up_loss), "stopped_early": True, "loss": loss,
            "give_up_loss": give_up_loss, "probe_right": correct}


def test_a_lambda_is_bad_for_a_family_when_its_error_there_is_above_delta() -> None:
    """In distribution 1 loss in 10 at delta 0.2: fine. Shifted: 6 acting requests, 3 losses
    (0.5): all 6 were served a bad lambda; the 4 flagged ones and the 2 after the fallback
    were not, whatever their losses; a request not counted (None) is in no rate."""
    recs = [rec(i, "in-dist", int(i == 0)) for i in range(10)]
    recs += [rec(10 + i, "shifted", int(i < 3)) for i in range(6)]
    recs += [rec(16 + i, "shifted", 1, flagged=True) for i in range(4)]
    recs += [rec(20 + i, "shifted", 0, lam=None, source="fallback") for i in range(2)]
    recs += [rec(22, "shifted", None)]
    mark_bad(recs, delta=0.2)
    assert [r["i"] for r in recs if r["bad"]] == [*range(10, 16), 22]
    segs = by_segment(recs)
    assert list(segs) == ["in-dist", "shifted"]
    assert segs["in-dist"]["bad_served"] == 0
    assert segs["shifted"]["bad_served"] == 7  # the uncounted one ran the same bad lambda
    err = segs["shifted"]["stop_error"]
    assert (err["k"], err["n"]) == (7, 12) and err["ci95"][0] < 7 / 12 < err["ci95"][1]
    assert segs["shifted"]["flagged"] == pytest.approx(4 / 13)
    assert first_reactions(recs, shift_start=10) == {"gate": 6, "alarm": None, "audit": 10}
    assert first_reactions(recs[:16], shift_start=10) == {"gate": None, "alarm": None,
                                                          "audit": None}
    # served as a flagged one by the gate alarm: full reasoning (lambda null, source fallback),
    # a reaction of the alarm's, not the audit's; no bad lambda whatever its loss
    alarmed = recs + [rec(23, "shifted", 1, lam=None, source="fallback", alarm=True)]
    mark_bad(alarmed, delta=0.2)
    assert not alarmed[-1]["acting"] and not alarmed[-1]["bad"]
    assert first_reactions(alarmed, shift_start=10) == {"gate": 6, "alarm": 13, "audit": 10}
    assert by_segment(alarmed)["shifted"]["alarm"] == pytest.approx(1 / 14)


def test_with_the_gate_alarm_every_gated_arm_gets_a_fresh_server() -> None:
    arms = ["full", "budget@48", "gated@0.1", "gated@0.2", "ungated@0.1", "two-sided@0.1"]
    assert arm_batches(arms, fresh=True) == [["full", "budget@48", "gated@0.1"], ["gated@0.2",
                                             "ungated@0.1"], ["two-sided@0.1"]]
    assert arm_batches(arms, fresh=False) == [arms]
    assert arm_batches(["gated@0.1"], fresh=True) == [["gated@0.1"]]


def test_a_point_against_the_budget_at_matched_tokens() -> None:
    budgets = [{"tokens": 100, "accuracy": 0.4, "n": 100},
               {"tokens": 200, "accuracy": 0.8, "n": 100}]
    v = against_budget({"tokens": 150, "accuracy": 0.7, "n": 100}, budgets)
    assert v["where"] == "interpolated" and v["budget_accuracy"] == pytest.approx(0.6)
    assert v["gap"] == pytest.approx(0.1)
    assert v["gap_ci95"][0] < 0.1 < v["gap_ci95"][1]
    above = against_budget({"tokens": 250, "accuracy": 0.7, "n": 100}, budgets)
    assert above["budget_accuracy"] == 0.8 and above["gap"] == pytest.approx(-0.1)
    assert "gap" not in against_budget({"tokens": 50, "accuracy": 0.7, "n": 100}, budgets)


def test_the_gap_interval_covers_at_its_level() -> None:
    """Newcombe's interval of a difference of proportions covers the true difference about 95%
    of the time (2,000 simulated pairs at n = 100, fixed seed; tolerance 2 points)."""
    import numpy as np

    rng = np.random.default_rng(0)
    p1, p2, n, hits = 0.7, 0.6, 100, 0
    for _ in range(2000):
        lo, hi = gap_interval(rng.binomial(n, p1) / n, n, rng.binomial(n, p2) / n, n)
        hits += lo <= p1 - p2 <= hi
    assert abs(hits / 2000 - 0.95) < 0.02
    assert all(math.isnan(x) for x in gap_interval(0.5, 0, 0.5, 10))


def test_a_labelled_response_becomes_a_record_and_the_report_reads_it() -> None:
    """`record` from a response as the server and the labeller leave it (stopped at step 2 of
    3; right from step 3 only: a stop error), then the summary and table of a run."""
    trace = {"labels": {"supervised": [0, 0, 1], "consistent": [0, 0, 1]}}
    resp = {"completion_tokens": 40, "correct": False, "trace": trace,
            "orca": {"enabled": True, "lambda": 0.4, "lambda_source": "bundle",
                     "stopped_early": True, "stop_step": 2, "ended": "early",
                     "shift": {"alpha": 0.05, "pvalue": 0.3, "flagged": False}}}
    prompt = {"i": 0, "id": "shifted-0", "segment": "shifted", "family": "shifted"}
    served = record({k: v for k, v in resp.items() if k != "trace"}, prompt, True,
                    excluded_never_correct=True, give_up_reference="supervised")
    assert (served["loss"], served["probe_right"], served["acting"]) == (None, None, True)
    mark_bad([served], delta=0.1)
    assert not served["bad"]  # not labelled: no error yet, so no bad lambda either
    assert by_segment([served])["shifted"]["stop_error"]["n"] == 0
    r = record(resp, prompt, True, excluded_never_correct=True, give_up_reference="supervised")
    assert (r["loss"], r["acting"], r["flagged"], r["give_up_loss"]) == (1, True, False, 0)
    full = {"i": 0, "id": "shifted-0", "segment": "shifted", "family": "shifted", "tokens": 60,
            "correct": True, "orca": False}
    runs = {"plain": {"arms": {"full": {"records": [full], "wall_s": 1.0},
                               "budget@50": {"records": [{**full, "tokens": 30}], "wall_s": 1.0},
                               "gated@0.1": {"records": [r], "wall_s": 1.0}}}}
    s = summarize(runs)
    g = s["arms"]["plain/gated@0.1"]
    assert g["bad_served"] == 1
    assert g["first_reaction"] == {"gate": None, "alarm": None, "audit": None}
    assert g["segments"]["shifted"]["versus_budget"]["budget_accuracy"] == 1.0
    assert "| plain | gated@0.1 | shifted | 1 | 40 | 0.000 (0.000) |" in table(s)
    # one counted stop error of 1 at delta 0.1: over delta, no two-sided arm beside it
    last = "| shifted | 0.1 | 1.000 (1/1; 0.025-1.000) | no |  |  |"
    assert done_means(s).splitlines()[-1] == last
