"""The vote's audit shared across a fleet: its events go through the audit journal on a real
Redis server (`redis_store`, tests/conftest.py), so replicas fold one sequence per consensus row
and a restart resumes it. Real redis-server, the server's LiveAudit; no engine.

The bound's statistical property is that of one sequence (tests/test_vote_audit.py: repeated
simulation at the hardest null); here the fleet is shown to BE that one sequence, exactly, after
every audited group, on a stream whose vote error rises past delta_vote."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from orca_method.outcomes import Source
from orca_serve.live_audit.journal import SNAPSHOT_EVERY
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig, audit_journal
from tests.test_voting import MSG, bundle, resolved

pytestmark = pytest.mark.usefixtures("quiet_audit_log")

# an audited group's vote error: at delta_vote (0.1) for 150 groups, then three times it
ERRORS = [0.1] * 150 + [0.3] * 150


def _replica(url: str | None, **config) -> LiveAudit:
    """A server's live audit of the consensus bundle: on the store at `url` (None: alone, its
    events applied directly)."""
    b = bundle()
    config = AuditConfig(seed=0, vote_rate=1.0, store=url, on_alarm="fallback", **config)
    return LiveAudit(b, config, journal=None if url is None else audit_journal(config, b))


def _vote():
    _, s = resolved({"messages": MSG, "orca": {"samples": 4}})
    return s.vote, s.delta


def test_two_replicas_fold_the_vote_sequence_of_one(redis_store):
    """Two replicas on one store, each taking every other audited group: after every group
    both (having read the other's events, as every request does) hold the vote row's bounds,
    alarm and decision of one process that saw every group; so do their admissions (t* acting
    or the fallback), and a replica started afterwards resumes the same row."""
    vote, delta = _vote()
    one = _replica(None)
    fleet = [_replica(redis_store.url) for _ in range(2)]
    rng = np.random.default_rng(35)
    engaged_at = None
    for i, err in enumerate(ERRORS):
        loss = None if rng.random() < 0.05 else float(rng.random() < err)  # some censored
        one.vote_finished(vote, delta, loss)
        fleet[i % 2].vote_finished(vote, delta, loss)
        row = one.votes.guard(delta, vote.delta_vote).row()
        for replica in fleet:
            replica.state.sync()
            assert replica.votes.guard(delta, vote.delta_vote).row() == row, (i, replica)
            assert replica.votes.admit(vote, delta).t_source == row["t_source"]
        if engaged_at is None and row["engaged"]:
            engaged_at = i
    assert engaged_at is not None and engaged_at >= 150, engaged_at  # the shift, not before
    assert row["n"] == len(ERRORS) and fleet[0].votes.counts["measured"] < len(ERRORS)
    late = _replica(redis_store.url)  # a restart: replays the store's events
    assert late.votes.guard(delta, vote.delta_vote).row() == row
    assert late.votes.admit(vote, delta).t_source == Source.FALLBACK
    for replica in (*fleet, late):
        replica.state.close()


def test_a_replica_resumes_the_vote_row_from_the_stores_snapshot(redis_store):
    """Past SNAPSHOT_EVERY events the snapshot on the store carries the vote guards: a new
    replica restores it and replays only what follows, to the same row."""
    vote, delta = _vote()
    a = _replica(redis_store.url)
    rng = np.random.default_rng(36)
    for _ in range(SNAPSHOT_EVERY + 40):
        a.vote_finished(vote, delta, float(rng.random() < 0.05))
    expect = a.votes.table()
    a.state.close()
    b = _replica(redis_store.url)
    assert b.state.replayed == 40 and b.votes.table()["rows"] == expect["rows"]
    b.state.close()



def test_a_store_restored_from_an_older_save_is_left_though_its_last_events_match(redis_store):
    """A vote's events carry no number (its row and loss), so the events the others append
    after the store lost some can be byte for byte the lost ones: replica a folded 12 groups,
    the third a vote error; the store comes back from an older save with the first 2 (which b
    had read), and b appends 10 groups without error. The list is as long as a read, its start
    marker the same, and its last 8 events a's last 8 (the check before compared those only):
    a must still leave the store, which no longer holds the error a folded."""
    vote, delta = _vote()
    a, b = _replica(redis_store.url), _replica(redis_store.url)
    for loss in (0.0, 0.0):
        a.vote_finished(vote, delta, loss)
    b.state.sync()
    for loss in (1.0, *[0.0] * 9):
        a.vote_finished(vote, delta, loss)
    r = redis.Redis.from_url(redis_store.url)
    events = f"orca:guard:{bundle().checksum}:events"
    r.ltrim(events, 0, 1)  # the older save
    for _ in range(10):
        b.vote_finished(vote, delta, 0.0)
    assert r.llen(events) == 12
    a.state.sync()
    assert not a.table()["store"]["up"] and b.table()["store"]["up"]
    assert a.votes.guard(delta, vote.delta_vote).cs.n == 12  # its own guard goes on from there
    for replica in (a, b):
        replica.state.close()
