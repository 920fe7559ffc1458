"""The give-up threshold recalibrated live from consistency-labelled audits (docs/METHOD.md
section 9, "Giving up under consistency labels"; docs/AUDIT.md, "The give-up risk"): the loss,
and statistically (seeded streams through the server's LiveAudit, tests/audit_simulation.py)
that a recalibrated mu holds the give-up delta on the shifted family, where the bundle's mu*
does not, and keeps giving up."""

from __future__ import annotations

import numpy as np
import pytest

from orca_method.give_up import (
    calibrate_give_up,
    consistency_give_up_losses,
    give_up_indices,
    request_consistency_give_up_loss,
)
from orca_method.outcomes import GiveUpPolicy
from tests import audit_simulation as sim


def test_the_consistency_give_up_loss_is_whether_giving_up_changed_the_answer() -> None:
    g = [0.9, 0.1, 0.9, 0.9]  # gives up at step 1 for mu >= 0.1
    assert request_consistency_give_up_loss(g, 0.2, [0, 0, 1, 1]) == 1  # not the final answer
    assert request_consistency_give_up_loss(g, 0.2, [0, 1, 0, 1]) == 0  # already the final one
    assert request_consistency_give_up_loss(g, 0.05, [0, 0, 1, 1]) == 0  # never gives up
    assert request_consistency_give_up_loss([0.9, 0.9, 0.9, 0.0], 0.2, [0, 0, 0, 0]) == 0  # last
    # "message" serves no answer: every give-up changes it
    assert request_consistency_give_up_loss(g, 0.2, [0, 1, 0, 1], GiveUpPolicy.MESSAGE) == 1
    tau = give_up_indices([np.asarray(g)], np.array([0.05, 0.2]))
    assert consistency_give_up_losses(tau, [[0, 0, 1, 1]]).tolist() == [[0], [1]]


def test_ltt_over_mu_certifies_the_consistency_loss() -> None:
    """200 traces give up at step 1 from mu 0.4 on, which changes the answer of about 20 %,
    and at step 0 from mu 0.9 on, which changes every one: LTT keeps mu below 0.4 at delta 0.1,
    and at delta 0.3 goes up to 0.8, not 0.9."""
    rng = np.random.default_rng(0)
    scores, labels = [], []
    for i in range(200):
        scores.append(np.array([0.9, 0.4, 0.9]))
        labels.append(np.array([0, int(rng.random() >= 0.2), 1]))
    (res,) = calibrate_give_up(scores, [], [0.1], grid=np.linspace(0, 1, 11),
                               consistency=labels)
    assert res.mu < 0.4
    (res,) = calibrate_give_up(scores, [], [0.3], grid=np.linspace(0, 1, 11),
                               consistency=labels)
    assert res.mu == pytest.approx(0.8) and res.give_up_rate == 1.0
    with pytest.raises(ValueError, match="consistency label"):
        calibrate_give_up(scores, [], [0.1], consistency=labels[:-1])


def _check(summary: dict, streams: int) -> None:
    eps = 0.05  # the give-up table's epsilon_2 (tests/bundles.give_up_table), per give-up delta
    tol = 3 * np.sqrt(eps * (1 - eps) / streams)
    assert summary["bundle_risk"] > 0.25  # the shift breaks the bundle's mu*
    assert summary["recalibrated"] == 1.0
    assert summary["bad"] <= eps + tol, summary
    assert summary["missed"] <= eps / 2 + tol, summary
    assert summary["served_risk"] <= sim.GIVE_UP_DELTA, summary
    assert summary["served_rate"] > 0.15, summary  # it still gives up


def test_recalibrated_mu_holds_the_give_up_delta_under_shift() -> None:
    """20 seeded streams of the shifted family (the bundle's mu*: consistency give-up risk 0.31,
    rate 0.46): every stream recalibrates, at most eps + 3 SE serve a mu whose true risk
    exceeds delta_2, the served mu's bound missed its risk in at most eps / 2 + 3 SE, and the
    served mus still give up on more than 15 % of requests."""
    _check(sim.give_up_recalibration(20, audits=260, window=100), 20)


@pytest.mark.slow
def test_recalibrated_mu_holds_the_give_up_delta_under_shift_200_streams() -> None:
    _check(sim.give_up_recalibration(200, audits=400, window=150), 200)


def _give_up_state(audit) -> list:
    out = []
    for g in audit.state.give_up_guards.values():
        r = g.served
        out.append((g.cs.n, g.cs.upper, g.engaged, g.mu, g.source, g.recalibrations,
                    g.waiting_since, None if r is None else (r.mu, r.k, r.cs.n, r.cs.upper)))
    return out


@pytest.mark.parametrize("every", [40, 600])
def test_a_restart_resumes_the_give_up_recalibration(tmp_path, every: int) -> None:
    """With a journal (every 40 audits: replayed events; every 600: from a snapshot too), a
    process built anew resumes the give-up guard as it was: its wait, its recalibrated mu and
    that mu's own statistics, after every restart, as one process that never restarted."""
    from orca_serve.live_audit.journal import Journal, journal_path
    from orca_serve.live_audit.live import LiveAudit
    from orca_serve.live_audit.options import AuditConfig
    from tests.bundles import with_give_up

    b = with_give_up(sim.bundle(), [(sim.GIVE_UP_DELTA, sim.GIVE_UP_MU)])
    config = AuditConfig(rate=1.0, on_alarm="recalibrate", window=60)

    def attached() -> LiveAudit:
        return LiveAudit(b, config, journal=Journal(journal_path(tmp_path, b.checksum),
                                                    b.checksum, fsync=False))

    alone, audit = LiveAudit(b, config), attached()
    s, y, g = sim.give_up_trajectories(np.random.default_rng(5), 700, sim.GIVE_UP_SHIFT)
    for i in range(700):
        for a in (alone, audit):
            a.observe(list(s[i]), list(y[i]), give_up=list(g[i]))
        if (i + 1) % every == 0:
            audit.state.close()
            audit = attached()
        assert _give_up_state(audit) == _give_up_state(alone), i
    assert alone.state.give_up_guard(sim.GIVE_UP_DELTA).recalibrations >= 1
