"""Selective labelling (orca_method/selective.py) certifies what every-step labelling certifies.

Synthetic traces with answers at every step: every-step labelling probes each labelled step;
selective labelling probes in rounds (`next_round`) with the same answers. The records are built
by the collector's own record code (`trajectory_fields`), so the fill of unprobed steps is the
one a job stores. LTT's lambda* (every delta, with its risk, p-value and savings) and the
give-up mu* must be equal, exactly, and the selective set must use fewer probes.
"""

from __future__ import annotations

import numpy as np
import pytest

from orca_method.answer_probes import trajectory_fields
from orca_method.give_up import calibrate_give_up, last_right, mu_grid
from orca_method.labels import labelled_steps
from orca_method.ltt import calibrate, default_grid
from orca_method.outcomes import GiveUpPolicy
from orca_method.risk import is_solvable
from orca_method.selective import DecidingSteps, deciding_steps, next_round

REFERENCE = "7"
DELTAS = (0.05, 0.1, 0.15, 0.2, 0.3)
LAMS, MUS = default_grid(1001), mu_grid(1001)


def synthetic_traces(n: int, seed: int) -> list[dict]:
    """Traces whose stop score rises once the answer settles and whose give-up score falls on
    the ones that never get there; answers wander, settle, and sometimes slip afterwards."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t_len = int(rng.integers(2, 70))
        settle = int(rng.integers(0, t_len)) if rng.random() < 0.8 else t_len  # t_len: never
        target = REFERENCE if rng.random() < 0.75 else "5"  # the answer it settles on
        answers = []
        for t in range(t_len):
            if t >= settle and rng.random() > 0.08:
                answers.append(target)
            else:
                answers.append(str(int(rng.integers(0, 12))) if rng.random() < 0.9 else None)
        rise = np.clip(np.arange(t_len) - settle + rng.normal(0, 3), -20, 20) / 4
        stop = 1 / (1 + np.exp(-(rise + rng.normal(0, 0.7, t_len))))
        give_up = np.clip(0.6 - 0.5 * (settle == t_len) * np.linspace(0, 1, t_len)
                          + rng.normal(0, 0.15, t_len), 0, 1)
        finished = rng.random() < 0.85  # otherwise the final answer is the last step's
        text = f"...</think> The answer is \\boxed{{{answers[-1] or 0}}}" if finished else "..."
        out.append({"id": f"p{i}", "answers": answers, "stop": stop, "give_up": give_up,
                    "text": text})
    return out


def record(trace: dict, probed: dict[int, str | None]) -> dict:
    return trajectory_fields(trace["id"], {"prompt": "q", "answer": REFERENCE},
                             text=trace["text"], finish_reason="stop",
                             completion_tokens=10 * len(trace["answers"]),
                             step_tokens=[10] * len(trace["answers"]), probed=probed)


def every_step(trace: dict, every: int) -> tuple[dict, int]:
    steps = labelled_steps(len(trace["answers"]), every)
    return record(trace, {t: trace["answers"][t] for t in steps}), len(steps)


def selective(trace: dict, every: int, policy: GiveUpPolicy) -> tuple[dict, int]:
    """The collector's rounds with the trace's answers as the engine: stop side under
    consistent labels, give-up side under supervised ones."""
    deciding = {
        "consistent": deciding_steps(trace["stop"], LAMS, label_every=every),
        "supervised": deciding_steps(None, LAMS, label_every=every,
                                     give_up_scores=trace["give_up"], mu_grid=MUS,
                                     solvable=policy == GiveUpPolicy.MESSAGE),
    }
    probed: dict[int, str | None] = {}
    while steps := next_round(deciding, record(trace, probed)["labels"], probed):
        assert steps <= set(labelled_steps(len(trace["answers"]), every))
        probed.update({t: trace["answers"][t] for t in steps})
    return record(trace, probed), len(probed)


def certify(records: list[dict], traces: list[dict], policy: GiveUpPolicy):
    """lambda* per delta under consistent labels, mu* per give-up delta under supervised."""
    keep = [i for i, r in enumerate(records) if is_solvable(r["labels"]["consistent"])]
    lam = calibrate([traces[i]["stop"] for i in keep],
                    [np.maximum.accumulate(records[i]["labels"]["consistent"]) for i in keep],
                    DELTAS, grid=LAMS)
    mu = calibrate_give_up([t["give_up"] for t in traces],
                           [last_right(r["labels"]["supervised"]) for r in records],
                           (0.02, 0.05, 0.1, 0.2), grid=MUS, policy=policy)
    return lam, mu, len(keep)


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("policy", [GiveUpPolicy.GUESS, GiveUpPolicy.MESSAGE])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_certificate_with_fewer_probes(every, policy, seed):
    traces = synthetic_traces(300, seed)
    full = [every_step(t, every) for t in traces]
    chosen = [selective(t, every, policy) for t in traces]
    lam_full, mu_full, n_full = certify([r for r, _ in full], traces, policy)
    lam_sel, mu_sel, n_sel = certify([r for r, _ in chosen], traces, policy)
    assert n_sel == n_full
    assert lam_sel == lam_full  # lambda*, risk, p-value, savings: every field, exactly
    assert mu_sel == mu_full
    assert any(np.isfinite(r.lam) for r in lam_full)  # a certificate worth comparing
    probes_full, probes_sel = sum(k for _, k in full), sum(k for _, k in chosen)
    assert probes_sel < 0.9 * probes_full


def test_still_needed_settles_each_side():
    """The two sides by hand: a right answer at a deciding point settles the stop points from it
    on; below it every candidate must be seen wrong; a give-up point needs a right step from
    its candidate on, else every candidate to the end."""
    d = DecidingSteps(candidates=tuple(range(10)), stops=(2, 6, 9))
    assert d.first_round() == {2, 6, 9}
    assert d.still_needed({2: 0, 6: 1, 9: 1}) == {0, 1}  # C[2] = 0 needs steps 0 and 1
    assert d.still_needed({0: 0, 1: 1, 2: 0, 6: 1, 9: 1}) == set()
    assert d.still_needed({2: 0, 6: 0, 9: 0}) == {0, 1, 3, 4, 5, 7, 8}  # solvable at all?
    g = DecidingSteps(candidates=(2, 5, 8, 9), give_ups=(3, 6))  # label_every 3
    assert g.first_round() == {2, 5}  # the answers those steps are filled from
    assert g.still_needed({2: 1, 5: 0}) == {8, 9}  # right after step 6?
    assert g.still_needed({2: 0, 5: 1}) == set()
