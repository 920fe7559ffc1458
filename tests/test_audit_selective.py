"""Selective audit labelling (orca_method/audit/labelling.py, `--orca-audit-label-steps
selective`): the guards decide exactly as with every step labelled, for fewer probes.

Two levels: a property test of the deciding points (hypothesis: random scores, answers and
thresholds; the losses every threshold reads and whether the audit counts equal every-step
labelling's), and seeded streams through the server's `LiveAudit` and `AuditLabeller` (its
rounds of probes, answered from a table instead of an engine): in distribution, then shifted,
under `recalibrate`, with cut audits, the bounds, alarms, served lambdas and recalibrations
after every audit equal those of the same stream labelled at every step.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_method.answer_probes import trajectory_fields
from orca_method.audit.labelling import audit_points
from orca_method.give_up import request_consistency_give_up_loss
from orca_method.risk import is_solvable, request_losses
from orca_method.selective import next_round
from orca_serve.live_audit.live import LiveAudit, _Job
from orca_serve.live_audit.options import AuditConfig
from tests import audit_simulation as sim
from tests.bundles import with_give_up
from tests.servers import orca_result

ANSWERS = ("r", "w", "v")
AUDITS = 600


def _labels(answers: list[str], probed: set[int], text: str) -> list[int]:
    """Consistency labels of a record with the answers of `probed` steps (the labeller's)."""
    rec = trajectory_fields("k", {"prompt": "p"}, text=text, finish_reason="stop",
                            completion_tokens=0, step_tokens=[1] * len(answers),
                            probed={t: answers[t] for t in probed})
    return rec["labels"]["consistent"]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 12), every=st.integers(1, 3))
def test_selected_steps_settle_every_threshold_as_every_step_labels(data, n: int,
                                                                     every: int) -> None:
    """Random scores, answers, final answers, thresholds (stop and give-up) and strides: the
    rounds' labels give every threshold's loss and the count of every-step labelling."""
    scores = data.draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
    answers = data.draw(st.lists(st.sampled_from(ANSWERS), min_size=n, max_size=n))
    lams = data.draw(st.lists(st.one_of(st.floats(0, 1), st.just(float("inf"))), min_size=1,
                              max_size=4))
    text = data.draw(st.sampled_from(["", "</think> \\boxed{r}", "</think> \\boxed{x}"]))
    shown = scores[:-1] if data.draw(st.booleans()) else scores  # the plugin may skip the last
    give_up = data.draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
    mus = data.draw(st.lists(st.floats(0, 1), max_size=3))
    points = audit_points(shown, n, lams, label_every=every, give_up_scores=give_up, mus=mus)
    assert points is not None
    probed: set[int] = set()
    todo = points.first_round()
    while todo:
        probed |= todo
        todo = next_round({"consistent": points}, {"consistent": _labels(answers, probed, text)},
                          probed)
    full = _labels(answers, set(points.candidates), text)
    part = _labels(answers, probed, text)
    assert is_solvable(part) == is_solvable(full)
    s = np.concatenate([shown, np.zeros(n - len(shown))])
    assert (request_losses(s, part, lams) == request_losses(s, full, lams)).all()
    for mu in mus:  # a recalibrated mu's loss reads the raw label at its give-up step
        assert (request_consistency_give_up_loss(give_up, mu, part)
                == request_consistency_give_up_loss(give_up, mu, full))
    assert probed <= set(points.candidates)


def _trace(rng: np.random.Generator, bias: float) -> tuple[np.ndarray, list[str], str, str]:
    """Scores, forced answers, response text and finish reason of one simulated audit: right
    from a uniform step on (the simulation's family), a right answer lost again at some steps,
    5 % never right, 10 % cut by max_tokens (the recording ends at the cut, no final answer
    written: its last step's answer is the reference)."""
    s, c = sim.trajectories(rng, 1, bias)
    s, c = s[0], c[0]
    answers = [("r" if rng.random() < 0.85 else "v") if y else str(rng.choice(["w", "v"]))
               for y in c]
    text = "</think> \\boxed{r}"
    if rng.random() < 0.05:
        text = "</think> \\boxed{x}"  # never right
    if rng.random() < 0.1:
        k = int(rng.integers(1, sim.STEPS))
        return s[:k + 1], answers[:k + 1], "", "length"
    return s, answers, text, "stop"


def _decisions(audit: LiveAudit) -> list[Any]:
    out: list[Any] = [dict(audit.counts)]
    for g in audit.state.guards.values():
        r = g.served
        out.append((g.cs.n, g.cs.censored, g.cs.lower, g.cs.upper, g.alarm, g.lam, g.source,
                    g.engaged, g.recalibrations, g.waiting_since,
                    None if r is None else (r.lam, r.cs.n, r.cs.lower, r.cs.upper)))
    for gu in audit.state.give_up_guards.values():
        r = gu.served
        out.append((gu.cs.n, gu.cs.upper, gu.engaged, gu.mu, gu.source, gu.recalibrations,
                    gu.waiting_since, None if r is None else (r.mu, r.cs.n, r.cs.upper)))
    return out


def _stream(seed: int, label_steps: str, two_sided: bool = False
            ) -> tuple[list[Any], int, int]:
    """Decisions after every audit, probes, and audits labelled selectively, of one stream:
    60 unshifted audits, then 540 shifted ones, `recalibrate` on windows of 150. `two_sided`:
    the bundle has a give-up row (mu* 0.2 at 0.1), and each audit give-up scores (given as
    its embeddings, which the audit's give-up replay hands on as they are: our own fake of
    the probe) that fall with the shift, so the give-up guard recalibrates too."""
    rng = np.random.default_rng(seed)
    answers: dict[str, list[str]] = {}
    texts: dict[str, str] = {}
    labeller = sim.TableLabeller(answers, texts)
    b = with_give_up(sim.bundle(), [(sim.GIVE_UP_DELTA, sim.GIVE_UP_MU)]) if two_sided else (
        sim.bundle())
    audit = LiveAudit(b, AuditConfig(rate=1.0, on_alarm="recalibrate", window=150,
                                     label_steps=label_steps), labeller=labeller)
    audit._give_up_scores = lambda e: None if e is None else [float(x) for x in e[:, 0]]
    history, selective = [], 0
    for i in range(AUDITS):
        s, ans, text, reason = _trace(rng, 0.0 if i < 60 else sim.SHIFT)
        key = f"a{i}"
        answers[key], texts[key] = ans, text
        n = len(s)
        g = 1 / (1 + np.exp(-rng.normal(1.5 - 2.0 * (i >= 60), 1.5, n)))  # [n]
        result = orca_result(policy="shadow", scores=[float(x) for x in s[:-1]],
                             step_tokens=[1] * n, step_token_ids=[[t] for t in range(n)],
                             prompt_token_ids=[100], output_token_ids=list(range(n)),
                             step_embeddings=g[:, None] if two_sided else None)
        seq = audit.state.admit()
        selective += audit.state.label_needs(seq) is not None
        asyncio.run(audit._process(_Job(key, {"prompt": "p"}, result, seq, reason)))
        history.append(_decisions(audit))
    return history, labeller.probes, selective


def test_selective_labelling_decides_as_every_step_labelling() -> None:
    """Two seeded streams: after every audit the guard's counts, bounds, alarm, served lambda
    and source, recalibrations and the recalibrated lambda's own bounds are equal (exactly),
    with fewer probes; the streams recalibrate and label some audits selectively, some in
    full (those a window may take), so both paths are exercised."""
    for seed in range(2):
        every, p_every, _ = _stream(seed, "every")
        sel, p_sel, n_sel = _stream(seed, "selective")
        assert sel == every
        guard = every[-1][1]
        assert guard[8] >= 1  # recalibrated at least once
        assert 0 < n_sel < AUDITS
        assert p_sel < 0.8 * p_every


def test_selective_labelling_decides_the_give_up_side_as_every_step_labelling() -> None:
    """A two-sided bundle whose give-up guard recalibrates mu from consistency labels: the
    stop and give-up guards' decisions after every audit are equal, with fewer probes."""
    every, p_every, _ = _stream(7, "every", two_sided=True)
    sel, p_sel, n_sel = _stream(7, "selective", two_sided=True)
    assert sel == every
    give_up = every[-1][2]
    assert give_up[5] >= 1 and give_up[7] is not None  # recalibrated, a mu audited
    assert 0 < n_sel < AUDITS and p_sel < p_every
