"""benchmarks/bench_samples_holdout.py: the capped rule's table, its paths, cross-fitting, and
the LTT of the capped path tested statistically (fast, hand-made and synthetic groups)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_samples import Trace  # noqa: E402
from bench_samples_holdout import CapGrid, certify, cross_fit, table  # noqa: E402

from orca_method.consensus import DEFAULT_CAP_MAX, NO_CAP, Group, first_t  # noqa: E402

DELTA_VOTE = 0.12  # between the pool's risk at the caps' end (~0.10) and with m = 1 (~0.15)


def traces_of(finish: list[float], answers: list[str]) -> list[Trace]:
    """Full traces ending where the group's samples finish, each with a 5-token answer."""
    return [Trace(cum=np.array([f]), step_answers=[a], final=a, completion=int(f) + 5)
            for f, a in zip(finish, answers)]


def test_the_sample_cap_settles_once_m_samples_have_finished():
    """Four samples finishing at 10, 20, 30, 40 answer 5, 4, 4, 4: maj@4 is 4. At first_t (0.34
    for k = 4) the margin settles at 30 (4 leads by 1, one sample running), so m = 4 and m = 3
    answer 4 there; m = 2 settles at 20 on a 1-1 tie, to the lowest sample (5); m = 1 at 10 on
    sample 0's 5."""
    finish, answers = [10.0, 20, 30, 40], ["5", "4", "4", "4"]
    g = Group(finish=np.array(finish), answers=tuple(answers), weights=np.ones(4),
              reference="4")
    t0 = first_t(4)
    t, c, most = np.full(4, t0), np.full(4, NO_CAP), np.array([4.0, 3, 2, 1])
    err, ok, tok = table([g], [traces_of(finish, answers)], ["4"], t, c, most)
    assert err[:, 0].tolist() == [False, False, True, True]
    assert ok[:, 0].tolist() == [True, True, False, False]
    # at 30: 10 + 20 + 30 + 30 tokens and 3 answers; at 20: 10 + 20 + 20 + 20 and 2; at 10: 4 x 10
    assert tok[:, 0].tolist() == [90 + 15, 90 + 15, 70 + 10, 40 + 5]


def test_the_caps_last_path_is_the_shipped_path_then_the_sample_cap():
    k = 8
    grid = CapGrid.of(k)
    path = grid.caps_last()
    t, c, m = grid.t[path], grid.c[path], grid.most[path]
    assert t[0] == 1.0 and np.all(np.diff(t) <= 0) and np.all(t >= first_t(k))
    on = c != NO_CAP
    assert np.all(np.diff(c[on]) >= 0) and c[on][0] == 25 and c[on].max() == DEFAULT_CAP_MAX
    assert np.all(m[:-(k - 1)] == k) and m[-(k - 1):].tolist() == list(range(k - 1, 0, -1))
    assert np.all(c[-(k - 1):] == DEFAULT_CAP_MAX)


def test_the_staircase_follows_the_lower_error_and_ends_at_the_bluntest_rule():
    """With errors that grow with c only, the staircase lowers m first, all the way down; then
    raises c. Every step moves one parameter one notch (c by `every` caps, m by one)."""
    k = 4
    grid = CapGrid.of(k)
    err = np.zeros((len(grid.t), 10))
    err[:, :5] = (grid.c > 0)[:, None]  # any clause errs on half the groups; caps on m none
    tok = np.ones_like(err)
    path = grid.staircase(err, tok, every=40)
    stair = path[grid.margin:]
    assert grid.most[stair].tolist()[:k] == [4, 3, 2, 1] and np.all(grid.c[stair][:k] == NO_CAP)
    assert grid.c[stair[-1]] == DEFAULT_CAP_MAX and grid.most[stair[-1]] == 1
    assert len(stair) == 1 + (k - 1) + 4  # 160 caps in steps of 40


def test_an_uncertified_fold_runs_its_samples_to_the_end():
    """Fold 0's groups all err at every hypothesis: certified on them, fold 1 gets nothing and
    answers maj@k at its full tokens; fold 1's groups never err, so fold 0 gets the last one."""
    H, n = 5, 200
    folds = np.arange(n) % 2
    err = np.zeros((H, n), bool)
    err[:, folds == 0] = True
    ok, tok = ~err, np.tile(np.arange(H, 0, -1.0)[:, None], (1, n))
    full, maj_ok = np.full(n, 99.0), np.ones(n, bool)
    s = cross_fit(err, ok, tok, full, maj_ok, folds, 0.1)
    assert s.rules == [H - 1, -1]
    assert np.all(s.tokens[folds == 1] == 99.0) and not s.err[folds == 1].any()
    assert np.all(s.tokens[folds == 0] == 1.0) and s.err[folds == 0].all()


def synthetic_errors(rng: np.random.Generator, n: int, k: int, t: np.ndarray, c: np.ndarray,
                     most: np.ndarray) -> np.ndarray:
    """[H, n] vote errors of n synthetic groups of k samples at every hypothesis: a group's
    samples give its right answer with a probability drawn per group, the rest split between
    two wrong ones; a fifth stop early, the right ones within 2,500 tokens (confident at a large
    enough c), the wrong ones beyond every c; the others run to their end."""
    err = np.zeros((len(t), n), bool)
    for j in range(n):
        right = rng.random(k) < rng.beta(4.0, 1.5)
        answers = np.where(right, "a", rng.choice(["b", "c"], k)).tolist()
        early = rng.random(k) < 0.2
        finish = np.where(early, np.where(right, rng.uniform(200, 2500, k),
                                          rng.uniform(4100, 5000, k)), rng.uniform(2000, 5000, k))
        ref = max(set(answers), key=lambda x: (answers.count(x), -answers.index(x)))
        g = Group(finish=finish, answers=tuple(answers), weights=np.ones(k), reference=ref,
                  stop_tokens=np.where(early, finish, np.inf))
        err[:, j] = table([g], [traces_of(finish.tolist(), answers)], [ref], t, c, most)[0][:, 0]
    return err


def test_the_capped_path_keeps_its_risk_within_delta_vote():
    """LTT over the caps-last path, statistically: a pool of 4,000 synthetic groups of k = 8
    (`synthetic_errors`), so every hypothesis's risk is exact (the pool mean); 400 draws (seed 0)
    of 300 groups; the certified hypothesis's pool risk <= delta_vote in >= 1 - epsilon - 0.035
    of the draws (0.035: 3 Monte-Carlo standard errors), and the sample cap is reached in some."""
    rng = np.random.default_rng(0)
    k, dv, eps = 8, DELTA_VOTE, 0.05
    grid = CapGrid.of(k)
    path = grid.caps_last()
    t, c, m = grid.t[path], grid.c[path], grid.most[path]
    err = synthetic_errors(rng, 4_000, k, t, c, m)
    risk = err.mean(axis=1)  # [H] the population's
    assert risk[-1] > dv > risk[0]  # the path crosses delta_vote: the test is not vacuous
    draws, within, capped = 400, 0, 0
    for _ in range(draws):
        h = certify(err[:, rng.choice(err.shape[1], 300, replace=False)], dv)
        within += h < 0 or risk[h] <= dv
        capped += h >= 0 and m[h] < k
    assert within / draws >= 1 - eps - 0.035
    assert capped > 0, "the sample cap was never certified: the test would not reach it"
