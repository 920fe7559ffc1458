"""One audit for a fleet: the journal on a real Redis server (`redis_store`, tests/conftest.py).

Real redis-server, real processes, the server's LiveAudit; no engine. The engine-side check
(two orca-serve processes on one store) is in tests/test_audit_fleet_server.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import multiprocessing
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from orca_serve.api_server import quiet_shutdown
from orca_serve.api_server.server import run
from orca_serve.checks.errors import Stopped
from orca_serve.live_audit.fleet import FleetJournal, MemoryJournal, store_metrics
from orca_serve.live_audit.journal import (
    SNAPSHOT_EVERY,
    UNRECORDED_FORMAT,
    FoldSettingsDiffer,
    Journal,
    JournalRefused,
    journal_path,
)
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import (
    FOLD_FORMAT,
    AuditConfig,
    add_audit_args,
    audit_journal,
    check_audit_args,
    fold_flags,
)
from orca_serve.live_audit.redis_journal import KeyOfAnotherType, RedisJournal
from orca_serve.settings.resolve import OrcaDefaults
from orca_serve.vllm_compat import launch
from tests.audit_simulation import DELTA, bundle, known_loss, restarted_stream
from tests.redis_server import RedisServer
from tests.servers import orca_server
from tests.serving import free_port

RISKS = [0.05] * 100 + [0.4] * 100  # a clean stretch, then a shift the alarm catches


pytestmark = pytest.mark.usefixtures("quiet_audit_log")


def _on_store(url: str, directory: Path | None = None, **config) -> LiveAudit:
    config = AuditConfig(store=url, directory=directory, **{"rate": 1.0, **config})
    return LiveAudit(bundle(), config, journal=audit_journal(config, bundle()))


def _append_many(url: str, tag: int, n: int, out, barrier) -> None:
    j = RedisJournal(url, bundle().checksum)
    seen = []
    barrier.wait()  # all start appending together
    for i in range(n):
        seen += j.append({"a": f"{tag}-{i}"})
    barrier.wait()  # all appended: a last read sees everything
    seen += j.read()
    out.put((tag, seen))
    j.close()


def test_concurrent_appends_from_processes_see_one_order(redis_store):
    """Four processes appending at once: each one's view (what every append handed back, then
    a last read) is the store's whole list, in the store's order, so all fold one sequence."""
    ctx = multiprocessing.get_context("fork")
    q, barrier = ctx.Queue(), ctx.Barrier(4)
    procs = [ctx.Process(target=_append_many, args=(redis_store.url, t, 200, q, barrier))
             for t in range(4)]
    for p in procs:
        p.start()
    views = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    j = RedisJournal(redis_store.url, bundle().checksum)
    whole = j.read()
    j.close()
    assert len(whole) == 800 and len({e["a"] for e in whole}) == 800
    for view in views.values():
        assert view == whole
    # the appends really interleaved (else the test shows nothing about concurrency)
    assert sum(a["a"][0] != b["a"][0] for a, b in itertools.pairwise(whole)) > 3


def test_four_replicas_fold_the_sequence_of_one(redis_store):
    """Four replicas on one store, each taking every fourth audit: after every audit each of
    them (having read the others' events, as every request does) holds the bounds, alarm and
    served lambda of one process that saw all audits, so the fleet's false alarms and delay
    are that process's (epsilon / 2, not four sequences' 4 x epsilon / 2 and 4 x the delay)."""
    one = restarted_stream(4, restart_every=None, risks=RISKS)
    fleet = [_on_store(redis_store.url, on_alarm="fallback") for _ in range(4)]
    rng = np.random.default_rng(4)  # restarted_stream's draws: the same losses in the same order
    for i, risk in enumerate(RISKS):
        fleet[i % 4].observe(*known_loss(bool(rng.random() < risk)))
        for replica in fleet:
            replica.state.sync()
            g = replica.state.guard(DELTA)
            assert (g.cs.lower, g.cs.upper, g.alarm, g.lam) == one.trace[i], (i, replica)
    assert one.ever_alarm and fleet[0].state.guard(DELTA).source == "fallback"
    for replica in fleet:
        replica.state.journal.close()


def test_snapshots_on_the_store_bound_the_replay(redis_store):
    """Every SNAPSHOT_EVERY events the folded state goes to the store; a new replica restores
    it and replays only the events after it, to the same state."""
    audit = _on_store(redis_store.url, on_alarm="fallback")
    rng = np.random.default_rng(5)
    for _ in range(SNAPSHOT_EVERY // 2 + 30):  # two events per audit
        audit.observe(*known_loss(bool(rng.random() < 0.2)))
    expect = audit.table()["deltas"]
    audit.state.journal.close()
    again = _on_store(redis_store.url, on_alarm="fallback")
    assert again.state.replayed == 60 and again.table()["deltas"] == expect
    again.state.journal.close()
    other = _on_store(redis_store.url, on_alarm="report")  # other settings: replays it all
    assert other.state.replayed == 2 * (SNAPSHOT_EVERY // 2 + 30)
    other.state.journal.close()


def test_a_snapshot_of_events_the_store_no_longer_holds_is_not_used(redis_store, monkeypatch):
    """The list lost its last events below the snapshot's length (a store restored from an
    older copy, the snapshot key not) and grew back to that length with other events: the
    snapshot's digest of its last event no longer matches, so the next replica replays the
    list rather than fold the lost audit's loss in place of its replacement's."""
    monkeypatch.setattr("orca_serve.live_audit.state.SNAPSHOT_EVERY", 50)
    audit = _on_store(redis_store.url)
    for i in range(25):
        audit.observe(*known_loss(i == 24))  # the snapshot covers the last one, loss 1
    audit.state.journal.close()
    r = redis.Redis.from_url(redis_store.url)
    events = f"orca:guard:{bundle().checksum}:events"
    r.ltrim(events, 0, 47)  # its admission and outcome are lost
    again = _on_store(redis_store.url)  # the snapshot covers more than the list: replayed
    again.observe(*known_loss(False))  # the replacement: back to the snapshot's length
    again.state.journal.close()
    assert r.llen(events) == 50
    third = _on_store(redis_store.url)
    assert third.state.replayed == 50 and third.state.guard(DELTA).cs.mean == 0.0
    third.state.journal.close()


FOLD_FLAGS = [  # (the running replica's flag that changes the fold, how the refusal names it)
    (dict(on_alarm="fallback"), "--orca-on-alarm fallback there, report here"),
    (dict(epsilon_split="joint"), "--orca-audit-epsilon-split joint there, per-delta here"),
    (dict(drift_acts=True), "--orca-audit-drift-acts on there, off here"),
    (dict(other_labels=True), "--orca-guard-other-labels on there, off here"),
]


@pytest.mark.parametrize("theirs, said", FOLD_FLAGS)
def test_a_replica_with_other_guard_flags_is_refused(redis_store, theirs, said):
    """A replica whose flags change the fold differently from the running replica's is
    refused, the flag named with both values, and leaves nothing in the store (its owner key
    is gone): on the same events its decisions would differ (before: it joined silently, and
    with fallback against report the two served different lambdas after 90 of 200 audits)."""
    first = _on_store(redis_store.url, **theirs)
    with pytest.raises(FoldSettingsDiffer, match=f"1 running process.*\\({said}\\)"):
        _on_store(redis_store.url)
    owners = redis.Redis.from_url(redis_store.url).keys("orca:guard-owner:*")
    assert owners == [f"orca:guard-owner:{first.state.journal.owner}".encode()]
    first.state.journal.close()


def test_the_refusal_names_every_differing_flag_and_only_those(redis_store):
    """Several flags differ: each is named with both values in one line; the window, read only
    when a guard recalibrates, is named as unused on the side that does not; what only picks,
    labels or stores audits differs freely."""
    first = _on_store(redis_store.url, on_alarm="recalibrate", window=50, drift_acts=True)
    with pytest.raises(FoldSettingsDiffer) as e:
        _on_store(redis_store.url, on_alarm="fallback")
    assert "(--orca-on-alarm recalibrate there, fallback here; --orca-recalibrate-window 50 " \
           "there, unused here; --orca-audit-drift-acts on there, off here)" in str(e.value)
    assert "\n" not in str(e.value)
    same = _on_store(redis_store.url, on_alarm="recalibrate", window=50, drift_acts=True,
                     rate=0.01, vote_rate=0.5, seed=3, queue=2, label_steps="selective")
    for audit in (first, same):
        audit.state.journal.close()


def test_once_every_replica_stopped_the_next_ones_flags_are_the_fleets(redis_store):
    """The flags are the running replicas': once they all left (a clean stop deletes the owner
    key), a replica with other flags joins and replays the list under its own, and then the
    old flags are the ones refused."""
    first = _on_store(redis_store.url, on_alarm="fallback")
    for _ in range(3):
        first.observe(*known_loss(False))
    first.state.journal.close()
    changed = _on_store(redis_store.url, on_alarm="report")
    assert changed.state.replayed == 6
    with pytest.raises(FoldSettingsDiffer, match="report there, fallback here"):
        _on_store(redis_store.url, on_alarm="fallback")
    changed.state.journal.close()


def test_a_server_that_stops_leaves_the_fleet_at_once(redis_store, monkeypatch):
    """orca-serve stopping (SIGTERM ends vLLM's launcher) closes its audit's journal: its owner
    key is gone when the process exits, so a fleet stopped to change a flag takes the new one
    at once. Before, the key outlived a clean stop by its TTL: measured with real orca-serve
    replicas, a replica started 3 s after the last one stopped, and a hot reload to a bundle
    whose only replica had just stopped, were refused as beside '1 running process(es)'."""
    audit = _on_store(redis_store.url, on_alarm="fallback")
    server = orca_server(bundle(), OrcaDefaults(enabled=True), audit=audit)

    def stopped(args, on_loop) -> None:
        raise Stopped(143)  # SIGTERM while serving (orca_serve.checks.errors.exit_on_sigterm)

    monkeypatch.setattr(launch, "run_single", stopped)
    monkeypatch.setattr(quiet_shutdown, "install", lambda client: None)  # vLLM's loggers alone
    with pytest.raises(Stopped):
        run(argparse.Namespace(api_server_count=1), server)
    assert redis.Redis.from_url(redis_store.url).keys("orca:guard-owner:*") == []
    _on_store(redis_store.url, on_alarm="report").close()


def _join_at_once(url: str, on_alarm: str, barrier, out) -> None:
    barrier.wait()
    try:
        audit = _on_store(url, on_alarm=on_alarm)
    except FoldSettingsDiffer:
        out.put((on_alarm, "refused"))
        barrier.wait()
        return
    out.put((on_alarm, "joined"))
    barrier.wait()  # the other has tried while this one ran
    audit.state.journal.close()


def test_two_replicas_with_other_flags_starting_at_once_one_is_refused(redis_store):
    """Two replicas with other flags join an empty store at the same moment, many times: one
    joins and the other is refused every time (the join is one transaction), never both."""
    ctx = multiprocessing.get_context("fork")
    r = redis.Redis.from_url(redis_store.url)
    for _ in range(10):
        r.flushdb()
        q, barrier = ctx.Queue(), ctx.Barrier(2)
        procs = [ctx.Process(target=_join_at_once, args=(redis_store.url, a, barrier, q))
                 for a in ("fallback", "report")]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(60)
        assert sorted(got.values()) == ["joined", "refused"], got


def _admit_and_die(url: str) -> None:
    audit = LiveAudit(bundle(), AuditConfig(rate=1.0),
                      journal=RedisJournal(url, bundle().checksum, owner_ttl=0.5))
    audit.observe(*known_loss(True))
    audit.state.admit()  # admitted, never resolved
    os._exit(0)  # a crash: no close, the heartbeat dies with the process


def _live_beside_a_dead_replica(url: str) -> LiveAudit:
    """A replica with an audit open, once another one that had an audit open died and its
    owner key ran out (two TTLs of the live one's, which its heartbeat renews)."""
    live = LiveAudit(bundle(), AuditConfig(rate=1.0),
                     journal=RedisJournal(url, bundle().checksum, owner_ttl=1.0))
    live.state.admit()
    p = multiprocessing.get_context("fork").Process(target=_admit_and_die, args=(url,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    time.sleep(2.0)
    return live


def test_a_dead_replicas_flags_bind_no_one(redis_store):
    """A replica that crashed holds the fleet's flags until its owner key expires (TTL 0.5 s):
    a replica with other flags is refused while it may still run, the refusal saying how long
    a crashed one counts (before, it said '1 running process(es)' of a process that was gone),
    and joins after."""
    p = multiprocessing.get_context("fork").Process(target=_admit_and_die,
                                                    args=(redis_store.url,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    with pytest.raises(FoldSettingsDiffer, match="off there, on here.*\\(one that crashed counts "
                       "as running until its owner key expires, 15 s\\)"):
        _on_store(redis_store.url, other_labels=True)
    time.sleep(1.0)  # two of its TTLs
    _on_store(redis_store.url, other_labels=True).state.journal.close()


NOT_RECORDS = [b"not json", b'{"settings": {"--orca-on-alarm": "fall', b"[]",
               b'{"settings": {}, "members": "abc"}', b'{"format": 0, "settings": {}, '
               b'"members": []}', {"settings": "{}"}, [b"{}"]]  # the last two: a hash, a list


def _put(r: redis.Redis, key: str, raw: bytes | dict | list) -> None:
    """Store `raw` under `key` in place of what it held: bytes as a string, a dict as a hash,
    a list as a list."""
    r.delete(key)
    if isinstance(raw, dict):
        r.hset(key, mapping=raw)
    elif isinstance(raw, list):
        r.rpush(key, *raw)
    else:
        r.set(key, raw)


@pytest.mark.parametrize("raw", NOT_RECORDS)
def test_a_fold_record_that_is_not_one_is_refused_while_a_replica_runs(redis_store, caplog, raw):
    """The fold key holds what is not a fold record (edited by hand, cut short, another value,
    a value of another type): while a replica runs, a joining one cannot know the flags it folds
    under and is refused, whatever its own flags, in one line naming the key and what to do.
    Before, the newcomer wrote the record anew with its own flags and folded the same events
    into other decisions; and a hash or a list there failed its GET (WRONGTYPE), taken for an
    unreachable store: the newcomer folded alone in memory. Once none runs, the next one
    writes it anew, said in the log."""
    key = f"orca:guard:{bundle().checksum}:fold"
    r = redis.Redis.from_url(redis_store.url)
    running = _on_store(redis_store.url, on_alarm="fallback")
    _put(r, key, raw)
    stored = r.dump(key)
    for on_alarm in ("report", "fallback"):
        with pytest.raises(FoldSettingsDiffer) as e:
            _on_store(redis_store.url, on_alarm=on_alarm)
        assert str(e.value).startswith(f"{redis_store.url} {key}: not a fold record (")
        assert str(e.value).endswith("stop them all, delete it, and start them again")
    assert r.dump(key) == stored
    running.state.journal.close()
    with caplog.at_level(logging.WARNING, logger="orca_serve.live_audit"):
        joined = _on_store(redis_store.url, on_alarm="report")
    assert f"{key} was not a fold record" in caplog.text
    with pytest.raises(FoldSettingsDiffer, match="fallback here"):
        _on_store(redis_store.url, on_alarm="fallback")
    joined.state.journal.close()


def test_a_replica_whose_fold_differs_is_refused_and_same_fold_versions_join(redis_store):
    """A replica of a version that folds the events otherwise (another FOLD_FORMAT) is refused
    beside running ones, both formats named; one of another release with the same format joins.
    A record written before the format was recorded (no "format": every such version folds as
    format 1, `UNRECORDED_FORMAT`) binds that fold: a format-1 replica joins it (and records
    the format), a format-2 one is refused. Before, only the flags were compared."""
    key = f"orca:guard:{bundle().checksum}:fold"
    r = redis.Redis.from_url(redis_store.url)
    flags = fold_flags(AuditConfig(rate=1.0))
    running = _on_store(redis_store.url)
    assert json.loads(r.get(key))["format"] == FOLD_FORMAT
    later = RedisJournal(redis_store.url, bundle().checksum)
    with pytest.raises(FoldSettingsDiffer, match=(
            f"{key.removesuffix(':fold')}:events: 1 running process\\(es\\) fold these audit "
            f"events by fold format {FOLD_FORMAT}, this one by format {FOLD_FORMAT + 1} "
            "\\(another orca-serve version, whose fold decides otherwise")):
        later.join(flags, FOLD_FORMAT + 1)
    later.join(flags, FOLD_FORMAT)  # another release, the same fold
    owners = [running.state.journal.owner, later.owner]
    assert json.loads(r.get(key))["members"] == owners
    r.set(key, json.dumps({"settings": flags, "members": owners}))  # the previous version's
    refused, upgraded = (RedisJournal(redis_store.url, bundle().checksum) for _ in range(2))
    with pytest.raises(FoldSettingsDiffer, match="by fold format 1, this one by format 2"):
        refused.join(flags, 2)
    upgraded.join(flags, UNRECORDED_FORMAT)
    assert json.loads(r.get(key))["format"] == UNRECORDED_FORMAT == 1
    for j in (running.state.journal, later, refused, upgraded):
        j.close()
    newer = RedisJournal(redis_store.url, bundle().checksum)
    newer.join(flags, 2)  # none runs: the fleet's fold is the next one's
    assert json.loads(r.get(key)) == {"format": 2, "settings": flags, "members": [newer.owner]}
    newer.close()


def test_a_dead_replicas_open_audit_is_reaped_a_live_ones_not(redis_store):
    """A replica that died with an audit open stops renewing its owner key; once the key's TTL
    ran out the next replica journals that audit as `lost` (a window would wait for it for
    ever). A live replica's key is renewed by its heartbeat, so its open audit stays open."""
    live = _live_beside_a_dead_replica(redis_store.url)
    late = LiveAudit(bundle(), AuditConfig(rate=1.0),
                     journal=RedisJournal(redis_store.url, bundle().checksum))
    assert late.state.lost == 1 and late.table()["open"] == 1
    assert late.state.guard(DELTA).cs.n == 1  # the dead one's labelled audit is in the risk
    for a in (live, late):
        a.state.journal.close()


def test_a_replica_that_waits_for_nothing_reaps_a_dead_ones_audits_too(redis_store,
                                                                       monkeypatch):
    """No guard waits for a window and no process starts: the replica that goes on serving
    still journals a dead replica's open audit as `lost` once its key expired (at most
    `REAP_EVERY` later), so its table's `open` comes back to what is really open."""
    monkeypatch.setattr("orca_serve.live_audit.state.REAP_EVERY", 0.5)
    live = _live_beside_a_dead_replica(redis_store.url)
    live.state.sync()
    assert live.state.lost == 1 and live.table()["open"] == 1
    live.state.journal.close()


def test_a_failed_beat_does_not_end_the_heartbeat(redis_store, caplog):
    """A renewal that raises something other than RedisError (a ValueError from the client) is
    logged, and the heartbeat goes on: the owner key outlives its TTL many times over."""
    j = RedisJournal(redis_store.url, bundle().checksum, owner_ttl=0.3)
    real, calls = j._renew, []

    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("I/O operation on closed file")
        real()

    j._renew = flaky  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="orca_serve.live_audit"):
        time.sleep(1.2)  # four TTLs
    assert j._heart.is_alive() and len(calls) >= 5
    assert redis.Redis.from_url(redis_store.url).exists(j._owner_key(j.owner))
    assert any("retrying at the next beat" in r.getMessage() for r in caplog.records)
    j.close()
    assert not j._heart.is_alive()


def test_close_during_a_beat_waits_for_it_and_no_beat_follows(redis_store, monkeypatch):
    """close() while a renewal is in flight: it waits for that renewal, then deletes the owner
    key for good (no later beat sets it again, so the others may reap this process's audits at
    once) and the heartbeat ends without an exception."""
    crashed: list[BaseException] = []
    monkeypatch.setattr("threading.excepthook", lambda a: crashed.append(a.exc_value))
    j = RedisJournal(redis_store.url, bundle().checksum, owner_ttl=0.3)
    real, started = j._renew, threading.Event()

    def slow() -> None:
        started.set()
        time.sleep(0.3)
        real()

    j._renew = slow  # type: ignore[method-assign]
    assert started.wait(5)
    j.close()
    time.sleep(0.5)  # a beat that slipped through would have set the key again by now
    assert not j._heart.is_alive() and not crashed
    assert not redis.Redis.from_url(redis_store.url).exists(j._owner_key(j.owner))


@pytest.mark.parametrize("policy, warned", [("noeviction", False), ("volatile-ttl", True)])
def test_a_store_that_may_evict_keys_is_warned_of(tmp_path, caplog, policy, warned):
    """A store that evicts when full drops the owner keys first under a volatile-* policy
    (the only keys with a TTL): measured, 400 cache keys with an hour's TTL in a 3 MB store
    evicted the running replica's key, and a replica with other guard flags joined beside it.
    Each replica warns at start unless the policy is noeviction (Redis's default)."""
    with RedisServer(tmp_path, "--maxmemory-policy", policy) as server, \
            caplog.at_level(logging.WARNING, logger="orca_serve.live_audit"):
        RedisJournal(server.url, bundle().checksum).close()
    said = [r.getMessage() for r in caplog.records if "may evict keys" in r.getMessage()]
    assert len(said) == int(warned), said
    assert not said or f"(maxmemory-policy {policy}): set it to noeviction" in said[0]


def test_a_replica_that_loses_the_store_keeps_its_own_guard(redis_store, caplog):
    """The store dies while a replica serves: the replica goes on with the state it had folded,
    in memory, says so once in the log and in /metrics (orca_audit_store_up 0) and the table,
    and its audits keep entering its own guard."""
    audit = _on_store(redis_store.url, on_alarm="fallback")
    for _ in range(10):
        audit.observe(*known_loss(False))
    assert audit.table()["store"]["up"]
    redis_store.stop()
    with caplog.at_level(logging.WARNING, logger="orca_serve.live_audit"):
        for _ in range(5):
            audit.observe(*known_loss(False))
        audit.state.sync()
    t = audit.table()
    assert t["store"]["up"] is False and t["store"]["down_since"] is not None
    assert t["journal"] == MemoryJournal.path and t["deltas"][0]["n"] == 15
    (g,) = store_metrics(audit.state.journal, "m")
    assert g.samples[0].value == 0.0 and g.samples[0].labels["store"] == redis_store.url
    warned = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warned) == 1 and "local guard" in warned[0].getMessage()
    audit.state.journal.close()


def test_a_store_unreachable_at_start_leaves_the_local_journal(tmp_path, caplog):
    """Nothing listens at the store's address: the replica starts with its own guard, the file
    journal of its audit directory when it has one (its restarts during the outage resume
    it), else one in memory."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="orca_serve.live_audit"):
        with_dir = FleetJournal(url, bundle().checksum, tmp_path)
    assert not with_dir.up and isinstance(with_dir.journal, Journal)
    assert with_dir.path == journal_path(tmp_path, bundle().checksum)
    assert any("unreachable at start" in r.getMessage() for r in caplog.records)
    with_dir.close()
    alone = FleetJournal(url, bundle().checksum, None)
    assert isinstance(alone.journal, MemoryJournal) and alone.append({"a": None}) == [{"a": None}]


def test_a_store_that_fails_mid_open_keeps_nothing_of_the_replica(redis_store):
    """The open fails after the replica set its owner key (here its `created` key holds a hash,
    which is refused: `test_a_journal_key_of_another_type_is_refused_and_kept`): the journal
    leaves neither its owner key on the store nor its connection open. Before, the key lived
    OWNER_TTL longer, counting a replica that folds alone among the fleet's running ones, and
    the connection stayed open as long as the refusal was kept."""
    r = redis.Redis.from_url(redis_store.url)
    r.hset(f"orca:guard:{bundle().checksum}:created", "x", "1")
    connections = len(r.client_list())
    with pytest.raises(KeyOfAnotherType) as refused:
        RedisJournal(redis_store.url, bundle().checksum)
    assert r.keys("orca:guard-owner:*") == []
    assert len(r.client_list()) == connections, refused  # kept: its frames hold the journal


# each key of the journal with what it must not hold: a value of another Redis type (the fold
# record's own rule: the test above), one key or several at once
OTHER_TYPES = [{"events": {"x": b"1"}}, {"events": b"a string"}, {"chain": b"a string"},
               {"created": [b"a", b"list"]}, {"snapshot": {"x": b"1"}},
               {"events": {"x": b"1"}, "created": {"x": b"1"}, "snapshot": [b"{}"]}]
KEPT = {"events": "its events (a list)", "chain": "their running digests (a list)",
        "created": "its start marker (a string)", "snapshot": "its snapshot (a string)"}
TYPES = {bytes: "string", dict: "hash", list: "list"}


@pytest.mark.parametrize("held", OTHER_TYPES, ids=lambda held: "+".join(
    f"{name}-{TYPES[type(raw)]}" for name, raw in held.items()))
def test_a_journal_key_of_another_type_is_refused_and_kept(redis_store, held):
    """A key of the journal holds another Redis type than the journal keeps there (another
    program's data under the audit's prefix, a store half migrated): a replica that opens it is
    refused, in one line naming each such key and what to do, with no other replica running
    (unlike a fold record, it is never written anew: it may be someone's data), and leaves it
    as it was, with no owner key and no fold record of its own. Before, the first call on it
    failed (WRONGTYPE), taken for an unreachable store: the replica folded alone in memory,
    apart from the fleet. Once the key is renamed away, as the line says, a replica joins."""
    r = redis.Redis.from_url(redis_store.url)
    keys = {name: f"orca:guard:{bundle().checksum}:{name}" for name in held}
    for name, raw in held.items():
        _put(r, keys[name], raw)
    stored = {name: r.dump(key) for name, key in keys.items()}
    with pytest.raises(KeyOfAnotherType) as e:
        _on_store(redis_store.url)
    named = "; ".join(f"{keys[name]} is a Redis {TYPES[type(raw)]}, where the audit journal "
                      f"keeps {KEPT[name]}" for name, raw in sorted(
                          held.items(), key=lambda kv: list(KEPT).index(kv[0])))
    # the refusal orca-serve's start turns into its one-line exit 2, as it does the fleet's
    # other refusal (test_audit_fleet_server: a replica with other guard flags), and a reload
    # into its 400 (test_reload)
    assert isinstance(e.value, JournalRefused)
    assert str(e.value) == (
        f"{redis_store.url}: {named}: another program's data under the audit's keys, or a store "
        "half migrated, which this replica neither reads as its audit's nor overwrites; rename "
        "each such key away (RENAME) or delete it, then start (or reload) again")
    assert {name: r.dump(key) for name, key in keys.items()} == stored
    assert r.keys("orca:guard-owner:*") == [] and not r.exists(
        f"orca:guard:{bundle().checksum}:fold")
    for key in keys.values():
        r.rename(key, f"{key}:moved")
    audit = _on_store(redis_store.url)
    audit.observe(*known_loss(False))
    assert audit.table()["store"]["up"] and audit.state.guard(DELTA).cs.n == 1
    audit.state.journal.close()


def test_a_key_that_changes_type_while_serving_is_left_said_as_an_error(redis_store, caplog):
    """The events key turns into a hash under a serving replica: its calls fail (WRONGTYPE), so
    it leaves the store for its own guard, and its warning says the store answered with an
    error (naming it), not that it is unreachable: the operator looks at the key, not at the
    network. Before, the warning said unreachable."""
    audit = _on_store(redis_store.url)
    audit.observe(*known_loss(False))
    _put(redis.Redis.from_url(redis_store.url), f"orca:guard:{bundle().checksum}:events",
         {"x": b"1"})
    with caplog.at_level(logging.WARNING, logger="orca_serve.live_audit"):
        audit.observe(*known_loss(False))
    assert not audit.table()["store"]["up"] and audit.state.guard(DELTA).cs.n == 2
    said = [r.getMessage() for r in caplog.records if "audit store" in r.getMessage()]
    assert len(said) == 1 and (f"the audit store {redis_store.url} answered a call with an "
                               "error while serving (WRONGTYPE") in said[0], said
    audit.state.journal.close()


def test_a_snapshot_key_that_changes_type_while_serving_is_not_overwritten(redis_store,
                                                                          monkeypatch):
    """The snapshot key turns into a hash under a serving replica: its next snapshot fails as
    every other call on a key of another type does (the replica leaves the store), and the
    hash, maybe another program's data, is left as it is. Before, the snapshot's SET replaced
    it without a word."""
    monkeypatch.setattr("orca_serve.live_audit.state.SNAPSHOT_EVERY", 4)
    audit = _on_store(redis_store.url)
    r = redis.Redis.from_url(redis_store.url)
    key = f"orca:guard:{bundle().checksum}:snapshot"
    audit.observe(*known_loss(False))  # two events: no snapshot yet
    _put(r, key, {"x": b"1"})
    audit.observe(*known_loss(False))  # the fourth event: a snapshot is due
    assert r.type(key) == b"hash" and r.hgetall(key) == {b"x": b"1"}
    assert not audit.table()["store"]["up"] and audit.state.guard(DELTA).cs.n == 2
    audit.state.journal.close()


def test_a_store_that_lost_events_is_left(redis_store):
    """A store restarted without persistence (or flushed) no longer holds what the replicas
    applied: a replica that notices leaves it for its own guard instead of folding a list whose
    start it never saw."""
    audit = _on_store(redis_store.url)
    for _ in range(3):
        audit.observe(*known_loss(False))
    redis.Redis.from_url(redis_store.url).flushdb()
    audit.observe(*known_loss(False))
    assert not audit.table()["store"]["up"] and audit.state.guard(DELTA).cs.n == 4
    audit.state.journal.close()


def test_a_store_restored_from_an_older_save_is_left_after_it_grew_back(redis_store, caplog):
    """The store comes back from an older save (or loses its last second under `everysec`)
    without replica a's last audits, and replica b, which never read them, appends past a's
    read position before a reads again: a must still leave the store (neither the list's
    length nor its start marker tells then), and nothing of a's goes into b's list."""
    a, b = _on_store(redis_store.url), _on_store(redis_store.url)
    for _ in range(2):
        a.observe(*known_loss(False))
    b.state.sync()  # b has read the 4 events the save keeps
    for _ in range(2):
        a.observe(*known_loss(True))  # lost with the restore
    events = f"orca:guard:{bundle().checksum}:events"
    r = redis.Redis.from_url(redis_store.url)
    r.ltrim(events, 0, 3)
    for _ in range(3):
        b.observe(*known_loss(False))  # the list grows back past a's 8 events
    with caplog.at_level(logging.WARNING, logger="orca_serve.live_audit"):
        a.observe(*known_loss(False))
    assert not a.table()["store"]["up"] and b.table()["store"]["up"]
    assert r.llen(events) == 10 and b.state.guard(DELTA).cs.n == 5
    # the log says what happened to the store, not that it could not be reached
    said = [r.getMessage() for r in caplog.records if "audit store" in r.getMessage()]
    assert len(said) == 1 and "lost events this replica had applied" in said[0], said
    for audit in (a, b):
        audit.state.journal.close()


def test_events_appended_without_the_chain_are_chained_not_taken_for_a_rollback(redis_store):
    """Elements pushed by a replica that keeps no running digest (an older version, during a
    rolling upgrade) are chained by the next script: the replicas that read them stay on the
    store, one that joins afterwards folds the same state, and the chain is the list's length."""
    a = _on_store(redis_store.url)
    a.observe(*known_loss(False))
    r = redis.Redis.from_url(redis_store.url)
    events = f"orca:guard:{bundle().checksum}:events"
    r.rpush(events, '{"a":"old"}', '{"r":2,"o":"risk","s":[1.0,1.0],"l":[0,1]}')
    b = _on_store(redis_store.url)
    for audit in (a, b):
        audit.observe(*known_loss(False))
    a.state.sync()
    assert a.table()["store"]["up"] and b.table()["store"]["up"]
    assert a.table()["deltas"] == b.table()["deltas"] and a.state.guard(DELTA).cs.n == 4
    assert r.llen(f"orca:guard:{bundle().checksum}:chain") == r.llen(events) == 8
    for audit in (a, b):
        audit.state.journal.close()


@pytest.mark.parametrize("argv, error", [
    (["--orca-audit-store", "http://x:1"], "is not a Redis URL"),
    (["--orca-audit-store", "redis://x:1/0", "--orca-audit-rate", "0"], "no request would"),
])
def test_bad_store_options_are_one_line_errors(argv, error):
    parser = argparse.ArgumentParser()
    add_audit_args(parser)
    ns = parser.parse_args(["--orca-audit-rate", "0.1", *argv])
    with pytest.raises(ValueError, match=error):
        check_audit_args(ns, has_bundle=True)
