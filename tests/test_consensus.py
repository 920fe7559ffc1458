"""The consensus stop for k samples (orca_method/consensus.py): the rule, and its LTT certificate
tested statistically (repeated simulation, fixed seed, stated tolerance)."""

from __future__ import annotations

import numpy as np
import pytest

from orca_method.consensus_ltt import calibrate_consensus
from orca_method.consensus import (
    NO_CAP,
    Group,
    confident_path,
    default_grid,
    first_t,
    format_waves,
    in_waves,
    launched,
    outcomes,
    parse_waves,
    plurality,
    prompt_of,
    sample_id,
    settle_events,
    verdict,
    vote_path,
)
from orca_method.ltt import binomial_pvalues, n_rejected

K = 8


def test_verdict_margin_against_the_running_samples():
    answers = ["7", "7", "7", None, None, None, None, None]
    finished = np.array([1, 1, 1, 0, 0, 0, 0, 0], dtype=bool)
    w = np.array([0.9, 0.8, 0.7, 0, 0, 0, 0, 0])
    v = verdict(answers, w, finished, t=0.4)  # margin 2.4 against 0.4 * 5 = 2.0
    assert v.settled and v.answer == "7" and v.margin == pytest.approx(2.4) and v.running == 5
    assert not verdict(answers, w, finished, t=0.5).settled  # 2.4 is not > 2.5
    assert not verdict(answers, w, np.zeros(K, dtype=bool), t=0.0).settled  # nobody finished


def test_all_finished_is_settled_and_ties_go_to_the_lowest_sample():
    answers = ["3", "5", "5", "3"]
    v = verdict(answers, np.ones(4), np.ones(4, dtype=bool), t=1.0)
    assert v.settled and v.answer == "3" and v.margin == 0.0
    assert plurality(["5", "3", "3", "5"]) == "5"
    assert plurality([None, None, "1"]) is None  # "no answer" is a vote like any other
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        verdict(answers, np.array([1.0, 1.0, 1.5, 1.0]), np.ones(4, dtype=bool), t=0.5)


def test_sample_ids_round_trip():
    assert prompt_of(sample_id("long-in-dist-4", 7)) == ("long-in-dist-4", 7)
    assert prompt_of("toy-3") == ("toy-3", 0)
    assert prompt_of("a#b") == ("a#b", 0)


def test_t_one_never_changes_the_vote():
    """At t = 1 the remaining samples cannot overturn the leader: the settled answer is the
    weighted vote of all k stopped answers, whenever the group settles."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        answers = tuple(rng.choice(["a", "b", "c"], size=K, p=[0.6, 0.3, 0.1]))
        g = Group(finish=rng.integers(1, 50, K).astype(float), answers=answers,
                  weights=rng.uniform(0, 1, K), reference=None)
        path = vote_path(g)
        e = int(settle_events(path, np.array([1.0]))[0])
        assert path.leaders[e] == plurality(answers, g.weights)
        # offline, the group ends where the engine's verdict first says settled
        said = [verdict(answers, g.weights, g.finish <= s, t=0.3).settled for s in path.times]
        assert said.index(True) == int(settle_events(path, np.array([0.3]))[0])


# ----------------------------------------------------------------- the certificate, simulated


def synthetic_groups(n: int, rng: np.random.Generator, agree: float = 0.5) -> list[Group]:
    """Groups of K samples: a share `agree` of easy prompts (the modal answer has probability
    0.92), the rest hard (0.5-0.75); a stopped sample keeps its full trace's answer with
    probability 0.98; a sample's score is higher when its answer is the modal one; finish
    times are log-normal token counts, shorter on easy prompts; 80% of the samples were stopped
    early by ORCA (their `stop_tokens`: their finish), the rest ran to their end."""
    groups = []
    for _ in range(n):
        easy = rng.random() < agree
        top = 0.92 if easy else rng.uniform(0.5, 0.75)
        p = np.array([top, *(np.full(3, (1 - top) / 3))])
        full = rng.choice(4, size=K, p=p)
        kept = rng.random(K) < 0.98
        stopped = np.where(kept, full, rng.integers(0, 4, K))
        w = np.where(stopped == 0, rng.beta(5, 2, K), rng.beta(2, 3, K))
        finish = np.round(rng.lognormal(6.2 if easy else 7.0, 0.5, K))
        groups.append(Group(finish=finish, answers=tuple(int(a) for a in stopped), weights=w,
                            reference=plurality([int(a) for a in full]),
                            stop_tokens=np.where(rng.random(K) < 0.8, finish, np.inf)))
    return groups


def repeated_draws(loss: np.ndarray, delta: float, epsilon: float, rng: np.random.Generator,
                   n_cal: int = 300, reps: int = 400) -> tuple[float, np.ndarray]:
    """LTT's fixed sequence on `reps` draws of `n_cal` groups (with replacement) from a pool
    whose losses `loss` [H, N] make every hypothesis's risk exact (the pool mean): the share of
    draws whose certified hypothesis has pool risk <= delta (none certified counts: the samples
    then run to their end), and each draw's certified index [reps] (-1: none)."""
    risk = loss.mean(axis=1)  # [H]
    lasts = np.empty(reps, dtype=int)
    for r in range(reps):
        idx = rng.integers(0, loss.shape[1], n_cal)
        counts = loss[:, idx].sum(axis=1, dtype=np.int64)
        lasts[r] = n_rejected(binomial_pvalues(counts, n_cal, delta), epsilon) - 1
    return float(np.mean((lasts < 0) | (risk[lasts] <= delta))), lasts


def test_certified_t_keeps_vote_risk_within_delta_in_repeated_draws():
    """The population is a pool of 20,000 synthetic groups (its risk at each t is exact); each
    repetition draws 300 calibration groups from it with replacement (i.i.d. from the pool),
    certifies t* and reads t*'s population risk. LTT promises risk <= delta_vote with
    probability >= 1 - epsilon; 400 repetitions estimate that probability with a standard error
    of ~0.011, so the test allows 1 - epsilon - 0.035 (3 standard errors)."""
    rng = np.random.default_rng(35)
    grid = default_grid()
    pool = synthetic_groups(20_000, rng)
    loss, _ = outcomes(pool, grid)  # [m, N]
    risk = loss.mean(axis=1)  # [m] the population risk of every t
    delta, epsilon, n_cal = 0.1, 0.05, 300
    assert risk[0] < delta < risk[-1], "the simulation must make the choice of t matter"
    within, lasts = repeated_draws(loss, delta, epsilon, rng)
    ts = np.where(lasts >= 0, grid[lasts], 1.0)
    assert within >= 1 - epsilon - 0.035
    # the same through the public entry point, on one draw: its t is one the sequence rejects
    draw = [pool[i] for i in rng.integers(0, len(pool), n_cal)]
    (res,) = calibrate_consensus(draw, [delta], epsilon=epsilon, grid=grid)
    assert res.t is not None and risk[int(np.argmin(np.abs(grid - res.t)))] <= delta + 0.02
    assert np.median(ts) < 1.0  # it does certify stopping before the trivial point


def test_certified_confident_rule_keeps_vote_risk_within_delta_in_repeated_draws():
    """The two-parameter rule (margin t, and one early stop within c tokens settles): the same
    repeated simulation as above over the fixed path `confident_path` (t from 1 down to
    `first_t`, then c up, then the lower t at the last cap). Each of 400 draws of 300 groups
    certifies (t*, c*); the population risk of the certified pair is <= delta_vote in
    >= 1 - epsilon - 0.035 of the draws (3 standard errors). The path must matter: the risk
    crosses delta_vote along the caps, and the certified pairs do settle with one sample (c* > 0
    in most draws)."""
    rng = np.random.default_rng(135)
    grid, caps = confident_path(K, cap_max=2000)
    pool = synthetic_groups(20_000, rng, agree=0.6)
    loss, tokens = outcomes(pool, grid, caps)  # [m, N]
    risk = loss.mean(axis=1)  # [m] the population risk of every (t, c) on the path
    delta, epsilon, n_cal = 0.1, 0.05, 300
    on_caps = caps > NO_CAP
    assert risk[~on_caps].max() < delta < risk[on_caps].max(), "the cap must matter"
    within, lasts = repeated_draws(loss, delta, epsilon, rng)
    assert within >= 1 - epsilon - 0.035
    assert np.mean((lasts >= 0) & on_caps[lasts]) > 0.5
    # the public entry point on one draw: its pair is one the path rejects, past the margin's
    # part, and it spends fewer tokens than that part's last t (the cap off) on the pool
    draw = [pool[i] for i in rng.integers(0, len(pool), n_cal)]
    (res,) = calibrate_consensus(draw, [delta], epsilon=epsilon, grid=grid, caps=caps)
    assert res.t == first_t(K) and res.cap is not None
    j = int(np.flatnonzero(caps == res.cap)[0])
    assert risk[j] <= delta + 0.02
    assert tokens[j].mean() < tokens[int(np.flatnonzero(~on_caps)[-1])].mean()


def test_one_confident_sample_settles_for_its_answer_only():
    """The confidence clause: a finished sample stopped early within the cap settles the vote
    when its answer leads; a confident sample of a trailing answer (tie to a lower sample), a
    stop above the cap, or a sample that ran to its end does not; engine and calibration agree."""
    answers = ["4", "5", None, None]
    stop = np.array([np.inf, 300.0, np.inf, np.inf])  # sample 0 ran to its end
    w = np.ones(4)
    lone = np.array([0, 1, 0, 0], dtype=bool)
    assert verdict(answers, w, lone, t=0.5, cap=300, stop_tokens=stop).settled
    assert not verdict(answers, w, lone, t=0.5, cap=299, stop_tokens=stop).settled
    assert not verdict(answers, w, lone, t=0.5, stop_tokens=stop).settled  # clause off
    both = np.array([1, 1, 0, 0], dtype=bool)  # a 1-1 tie: "4" leads (lowest sample)
    v = verdict(answers, w, both, t=0.5, cap=1000, stop_tokens=stop)
    assert v.answer == "4" and not v.settled
    g = Group(finish=np.array([500.0, 300.0, 700.0, 800.0]), answers=("4", "5", "5", "4"),
              weights=w, reference="5", stop_tokens=np.array([np.inf, 300.0, 700.0, 800.0]))
    path = vote_path(g)
    assert path.backing.tolist() == [300.0, np.inf, 300.0, 800.0]  # ties: "4" at 500 and 800
    e = settle_events(path, np.array([1.0, 1.0, 0.9]), np.array([NO_CAP, 300.0, 299.0]))
    assert e.tolist() == [3, 0, 2]  # the last: at 700 by the margin (1 > 0.9 * 1)
    said = [verdict(g.answers, w, g.finish <= s, t=1.0, cap=300, stop_tokens=g.stop_tokens).settled
            for s in path.times]
    assert said.index(True) == 0
    with pytest.raises(ValueError, match="confidence path"):
        calibrate_consensus([g], [0.1], grid=np.array([1.0, 1.0]), caps=np.array([5.0, 4.0]))


def test_the_rule_saves_samples_when_answers_agree_early():
    """Certified on one draw, the rule spends far fewer tokens on groups that agree than on
    groups that do not, and fewer than running every sample to its ORCA stop."""
    rng = np.random.default_rng(36)
    cal = synthetic_groups(400, rng)
    (res,) = calibrate_consensus(cal, [0.1], epsilon=0.05)
    assert res.t is not None and res.token_savings > 0.15
    grid = np.array([res.t])
    easy, hard = synthetic_groups(500, rng, agree=1.0), synthetic_groups(500, rng, agree=0.0)
    full = {name: sum(g.spent(np.inf) for g in gs) for name, gs in
            (("easy", easy), ("hard", hard))}
    saved = {name: 1 - outcomes(gs, grid)[1].sum() / full[name] for name, gs in
             (("easy", easy), ("hard", hard))}
    assert saved["easy"] > 0.35
    assert saved["easy"] > saved["hard"] + 0.05


def test_waves_launch_later_samples_only_when_needed():
    """In waves (2, 2) a group whose first two samples agree at t = 0.4 settles before the
    second wave starts: it spends the first wave's tokens only; the second wave's samples count
    as running until they are launched."""
    start, finish = in_waves(np.array([100.0, 120.0, 90.0, 80.0]), (2, 2))
    assert start.tolist() == [0, 0, 120, 120] and finish.tolist() == [100, 120, 210, 200]
    g = Group(finish=finish, answers=("4", "4", "5", "5"), weights=np.ones(4), reference="4",
              start=start)
    path = vote_path(g)
    e = int(settle_events(path, np.array([0.4]))[0])  # at 120: margin 2 > 0.4 * 2
    assert path.times[e] == 120 and path.leaders[e] == "4" and g.spent(path.times[e]) == 220
    assert int(settle_events(path, np.array([1.0]))[0]) == len(path.times) - 1  # 2 > 2 fails
    assert g.spent(np.inf) == 390
    with pytest.raises(ValueError, match="summing to k"):
        in_waves(np.ones(4), (2, 1))
    (w,) = launched([Group(finish=np.array([100.0, 120.0, 90.0, 80.0]), answers=("4",) * 4,
                           weights=np.ones(4), reference="4")], (2, 2))
    assert w.start.tolist() == start.tolist() and w.finish.tolist() == finish.tolist()


def test_a_wave_schedule_is_spelled_one_way():
    assert parse_waves("1+1+2+4") == (1, 1, 2, 4) and format_waves((1, 1, 2, 4)) == "1+1+2+4"
    for bad in ("1+0+2", "1,2", "", "2+x"):
        with pytest.raises(ValueError):
            parse_waves(bad)
