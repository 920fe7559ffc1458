"""The audit's state across restarts and processes: the journal, its snapshots, shared stores.

Real files, real processes (multiprocessing), the server's LiveAudit; no engine. The engine-side
check (two orca-serve processes on one --orca-audit-dir) is in tests/test_audit_server.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from orca_serve.live_audit.factory import make_live_audit
from orca_serve.live_audit.handover import successor, take_over
from orca_serve.live_audit.journal import (
    OWNERS,
    SNAPSHOT_EVERY,
    FoldSettingsDiffer,
    Journal,
    journal_path,
)
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig, audit_journal
from orca_serve.live_audit.store import AuditStore
from tests.audit_simulation import DELTA, bundle, known_loss, restarted_stream

RISKS = [0.05] * 130 + [0.4] * 470  # a clean stretch, then a shift the alarm catches


pytestmark = pytest.mark.usefixtures("quiet_audit_log")


def _journal(d: Path, fsync: bool = False) -> Journal:
    b = bundle()
    return Journal(journal_path(d, b.checksum), b.checksum, fsync=fsync)


def _attached(d: Path, **config) -> LiveAudit:
    return LiveAudit(bundle(), AuditConfig(rate=1.0, **config), journal=_journal(d))


@pytest.mark.parametrize("policy", ["fallback", "recalibrate"])
def test_restarts_resume_the_uninterrupted_state(policy, tmp_path):
    """A process restarted every 100 audits that attaches the journal has, after every audit,
    the bounds, alarm and served lambda of one that never restarted (so its false alarms are
    that process's, epsilon / 2, not epsilon / 2 per start), and after the shift's alarm the
    bundle's lambda* is not served again. Without the journal (every start empty, as before)
    the restarts serve the alarmed lambda* again."""
    kw = {"risks": RISKS, "on_alarm": policy, "window": 50}
    whole = restarted_stream(3, restart_every=None, **kw)
    resumed = restarted_stream(3, restart_every=100, journal_dir=tmp_path, **kw)
    empty = restarted_stream(3, restart_every=100, **kw)
    assert whole.ever_alarm and resumed.trace == whole.trace
    assert resumed.bundle_lambda_served == whole.bundle_lambda_served
    assert empty.bundle_lambda_served > whole.bundle_lambda_served + 20, (  # measured 121, 89
        empty.bundle_lambda_served, whole.bundle_lambda_served)


def test_snapshots_bound_the_replay_and_are_checked(tmp_path):
    """Every SNAPSHOT_EVERY events a snapshot is written; a new process restores it and
    replays only the events after it, to the same state. A torn or foreign snapshot, or one
    folded under other settings, is not used: the journal is replayed whole instead."""
    audit = _attached(tmp_path, on_alarm="fallback")
    rng = np.random.default_rng(5)
    for _ in range(SNAPSHOT_EVERY // 2 + 30):  # two events per audit
        audit.observe(*known_loss(bool(rng.random() < 0.2)))
    snap = audit.state.journal.snapshot_path
    assert snap.is_file()
    expect = audit.table()["deltas"]
    audit.state.journal.close()
    again = _attached(tmp_path, on_alarm="fallback")
    assert again.state.replayed == 60 and again.table()["deltas"] == expect
    again.state.journal.close()
    for bad in ("{torn", json.dumps({"bundle_checksum": "other", "offset": 10})):
        snap.write_text(bad)
        full = _attached(tmp_path, on_alarm="fallback")
        assert full.state.replayed == 2 * (SNAPSHOT_EVERY // 2 + 30)
        assert full.table()["deltas"] == expect
        full.state.journal.close()
    other = _attached(tmp_path, on_alarm="report")  # another policy: the fold differs
    assert other.state.replayed == 2 * (SNAPSHOT_EVERY // 2 + 30)
    other.state.journal.close()


def test_a_snapshot_folded_by_another_fold_format_is_not_restored(tmp_path, monkeypatch):
    """A version whose fold differs (FOLD_FORMAT bumped) replays the journal whole rather than
    restore a snapshot folded by the old format: that state is the old fold's. Snapshots of
    format 1 carry no format, so the snapshots of before it stay usable."""
    from orca_serve.live_audit import state

    audit = _attached(tmp_path)
    for _ in range(SNAPSHOT_EVERY // 2 + 30):  # two events per audit
        audit.observe(*known_loss(False))
    audit.state.journal.close()
    assert "fold_format" not in json.loads(
        audit.state.journal.snapshot_path.read_text())["state"]["settings"]
    monkeypatch.setattr(state, "FOLD_FORMAT", 2)
    bumped = _attached(tmp_path)
    assert bumped.state.replayed == 2 * (SNAPSHOT_EVERY // 2 + 30)
    bumped.state.journal.close()


def _killed_after_admitting(d: str) -> None:
    audit = _attached(Path(d))
    audit.observe(*known_loss(True))  # labelled and journalled
    audit.state.admit()  # admitted, never resolved
    os._exit(0)  # no close, no flush of anything else: a crash


def test_a_crash_loses_no_labelled_audit_and_leaves_no_wait(tmp_path):
    """A process killed right after an audit was labelled: the audit is in the journal; its
    admission that never resolved is reaped as `lost` once its process is gone (it would keep
    a recalibration window waiting for ever); a torn last line is cut off."""
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_killed_after_admitting, args=(str(tmp_path),))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    path = journal_path(tmp_path, bundle().checksum)
    with open(path, "ab") as f:
        f.write(b'{"r": 2, "o": "ri')  # a write torn by a crash
    audit = _attached(tmp_path)
    g = audit.state.guard(DELTA)
    assert g.cs.n == 1 and g.cs.mean == 1.0 and audit.state.lost == 1
    assert audit.table()["open"] == 0 and path.read_bytes().endswith(b"\n")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[-1] == {"r": 2, "o": "lost"}


def _feed(d: str, seed: int, n: int, out) -> None:
    audit = _attached(Path(d), on_alarm="fallback")
    rng = np.random.default_rng(seed)
    for _ in range(n):
        audit.observe(*known_loss(bool(rng.random() < 0.3)))
    row = next(r for r in audit.table()["deltas"] if r["delta"] == DELTA)  # table() syncs
    out.put((seed, row))
    audit.state.journal.close()


def test_two_processes_share_one_sequence(tmp_path):
    """Two processes feeding audits at the same time through one journal end with one
    sequence (both audits' counts, the same bounds, alarm and served lambda), and a third
    that starts afterwards resumes exactly that."""
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_feed, args=(str(tmp_path), seed, 80, q)) for seed in (1, 2)]
    for p in procs:
        p.start()
    rows = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    third = _attached(tmp_path, on_alarm="fallback")
    final = next(r for r in third.table()["deltas"] if r["delta"] == DELTA)
    assert final["n"] == 160 and third.state.admitted == 160
    # the process that finished last saw everything; the other at least its own 80
    last = max(rows.values(), key=lambda r: r["n"])
    assert last == final and min(r["n"] for r in rows.values()) >= 80
    assert final["alarm"] and final["lambda_source"] == "fallback"  # risk 0.3 vs delta 0.1


def test_stores_of_two_servers_never_share_a_directory(tmp_path):
    """Two writers on one audit root take different audit-NNNNNN directories (each holds a
    lock on its own), and rotation never deletes a directory a live writer holds."""
    b = bundle()
    info = {"model": "m", "source": "test"}
    emb = np.ones((2, b.model.hidden_size), dtype=np.float32)
    rec = {"step_tokens": [1, 1], "labels": {"consistent": [0, 1]}}
    first = AuditStore(tmp_path, dim=b.model.hidden_size, info=info, per_dir=2, keep=1)
    second = AuditStore(tmp_path, dim=b.model.hidden_size, info=info, per_dir=2, keep=1)
    assert first.current != second.current
    for i in range(5):  # the second rotates three times with keep=1
        second.append({"id": f"b{i}", **rec}, emb)
    first.append({"id": "a0", **rec}, emb)
    assert first.current.is_dir() and len(first._writer.ids) == 1
    second.close()
    first.close()
    restarted = AuditStore(tmp_path, dim=b.model.hidden_size, info=info, per_dir=2, keep=1)
    assert restarted.current.is_dir()
    restarted.close()


def _open_files() -> list[str]:
    """What this process holds open (/proc/self/fd's targets)."""
    fds = Path("/proc/self/fd")
    return sorted(str(p.readlink()) for p in fds.iterdir() if p.exists())


def test_a_journal_of_another_bundle_is_refused_and_holds_nothing(tmp_path):
    """Refused, the journal lets go of its file and of its owner lock at once: a hot reload
    refused for it is retried, and before, each try kept the file open for the process's life
    and its owner lock until the garbage collector came by (a running process, to the others)."""
    b = bundle()
    path = journal_path(tmp_path, b.checksum)
    Journal(path, "f" * 64).close()
    before = _open_files()
    for _ in range(3):
        with pytest.raises(ValueError, match="another bundle"):
            Journal(path, b.checksum)
    assert _open_files() == before
    assert list((tmp_path / OWNERS).iterdir()) == []


def test_a_hot_reload_away_and_back_resumes_the_bundles_state(tmp_path):
    """Each bundle has its own journal: a reload to another bundle starts that one's (empty),
    and a reload back to the first resumes the first's sequences (alarm included)."""
    from orca_serve.live_audit.options import audit_journal

    first = bundle()
    other = first.model_copy(update={"checksum": "0" * 64})
    config = AuditConfig(rate=1.0, on_alarm="fallback", directory=tmp_path)
    a = LiveAudit(first, config, journal=audit_journal(config, first))
    rng = np.random.default_rng(8)
    for _ in range(120):
        a.observe(*known_loss(bool(rng.random() < 0.4)))
    before = a.table()["deltas"]
    assert before[0]["engaged"]
    b = take_over(a, successor(a, other, config))
    assert b.state.journal.path != journal_path(tmp_path, first.checksum)
    assert b.state.guard(DELTA).cs.n == 0 and a.state.journal is None  # closed by the hand-over
    back = take_over(b, successor(b, first, config))
    assert back.state.journal.path == journal_path(tmp_path, first.checksum)
    assert back.table()["deltas"] == before
    back.state.journal.close()


def test_a_hand_over_to_a_directory_that_cannot_be_opened_still_returns_a_working_audit(
        tmp_path, caplog):
    """The successor of a hot reload whose audit directory cannot be opened audits without it
    (logged), with the old audit's engine client."""
    engine = object()
    old = LiveAudit(bundle(), AuditConfig(rate=1.0), engine_client=lambda: engine)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level("WARNING", logger="orca_serve.live_audit"):
        new = take_over(old, successor(old, bundle(), AuditConfig(rate=1.0,
                                                                  directory=blocked)))
    assert "cannot open its directory" in caplog.text and old.retired
    assert new.store is None and new.state.journal is None and new.engine_client() is engine
    new.observe(*known_loss(True))
    assert new.state.guard(DELTA).cs.n == 1 and new.table()["directory"] is None


def test_two_servers_sharing_a_directory_fold_under_one_set_of_flags(tmp_path):
    """A server whose guard flags differ from those of a running server on the directory's
    journal is refused, naming the flag (on the same events they would decide differently);
    once that one stopped, its flags are free to change (the journal replays under them)."""
    a = _attached(tmp_path, on_alarm="fallback")
    a.observe(*known_loss(False))
    with pytest.raises(FoldSettingsDiffer, match="--orca-on-alarm fallback there, report here"):
        _attached(tmp_path)
    assert _attached(tmp_path, on_alarm="fallback", queue=3).state.replayed == 2
    a.state.journal.close()
    b = _attached(tmp_path)
    assert b.state.replayed == 2 and b.config.on_alarm == "report"
    b.state.journal.close()


@pytest.mark.parametrize("raw", [b'{"format": 1, "settings": {"--orca-on-alarm": "fall', b"{}",
                                 b"\x00" * 64])
def test_a_fold_record_that_is_not_one_is_refused_while_a_server_runs(tmp_path, caplog, raw):
    """The directory's fold record is not one (cut short, emptied, zeros after a power cut): a
    server that starts beside a running one cannot know its flags, so it is refused in one line
    naming the file and what to do. Before, it wrote the record anew with its own flags and
    folded the running server's events into other decisions. Once none runs, the next one
    writes it anew, said in the log; a missing record is simply none yet."""
    a = _attached(tmp_path, on_alarm="fallback")
    fold = a.state.journal.fold_path
    fold.write_bytes(raw)
    with pytest.raises(FoldSettingsDiffer) as e:
        _attached(tmp_path)
    assert str(e.value) == (f"{fold}: not a fold record ({raw[:60]!r}), so the settings that "
                            "running processes fold these audit events under are unknown; stop "
                            "them all, delete it, and start them again")
    assert fold.read_bytes() == raw
    a.state.journal.close()
    with caplog.at_level("WARNING", logger="orca_serve.live_audit"):
        b = _attached(tmp_path)
    assert f"{fold} was not a fold record" in caplog.text
    assert json.loads(fold.read_text())["settings"]["--orca-on-alarm"] == "report"
    b.state.journal.close()
    fold.unlink()
    caplog.clear()
    with caplog.at_level("WARNING", logger="orca_serve.live_audit"):
        _attached(tmp_path).state.journal.close()
    assert "fold record" not in caplog.text and fold.exists()


def test_a_server_refused_for_its_flags_leaves_no_audit_directory(tmp_path):
    """The refused server opens no `audit-NNNNNN` of its own: the running one holds the newest,
    so before, each refused start (a supervisor restarting it in a loop) added an empty one,
    whose rotation could delete the oldest kept audits past --orca-audit-keep."""
    config = AuditConfig(rate=1.0, directory=tmp_path, keep=1)
    running = make_live_audit(bundle(), replace(config, on_alarm="fallback"))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(FoldSettingsDiffer, match="fallback there, report here"):
        make_live_audit(bundle(), config)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    running.close()


def test_a_reloads_successor_binds_the_new_journal_to_its_flags_until_the_swap(tmp_path):
    """A reload's successor (its check) is refused by a journal folded under other flags. One
    that joined is a running process of its journal from then on: a server with other flags
    that starts before the swap is refused (before, the check left the journal, such a server
    joined, and the successor audited without journal and directory), and the successor takes
    over with its journal."""
    other = bundle().model_copy(update={"checksum": "0" * 64})
    config = AuditConfig(rate=1.0, directory=tmp_path)
    running = LiveAudit(other, replace(config, drift_acts=True),
                        journal=audit_journal(config, other))
    old = LiveAudit(bundle(), config, journal=audit_journal(config, bundle()))
    with pytest.raises(FoldSettingsDiffer, match="drift-acts on there, off here"):
        successor(old, other, config)
    running.state.journal.close()
    new = successor(old, other, config)
    with pytest.raises(FoldSettingsDiffer, match="drift-acts off there, on here"):
        make_live_audit(other, replace(config, drift_acts=True))
    assert take_over(old, new) is new and old.state.journal is None
    assert new.state.journal.path == journal_path(tmp_path, other.checksum)
    assert new.store is not None
    new.close()


DEMO = Path(__file__).parents[1] / "orca_serve" / "demo" / "bundle.json"


def _two_sided(d: Path) -> LiveAudit:
    from orca_method.bundle import load_bundle

    b = load_bundle(DEMO)  # two-sided: give-up guards beside the stop guards
    return LiveAudit(b, AuditConfig(rate=1.0, on_alarm="fallback", other_labels=True),
                     journal=Journal(journal_path(d, b.checksum), b.checksum, fsync=False))


def test_give_up_sequences_resume_and_an_old_journal_replays_the_same(tmp_path, monkeypatch):
    """The give-up scores travel in the outcome events ("g"), so a restart resumes the give-up
    sequences and their alarm with the stop ones (from a snapshot, which keeps the give-up
    guards, and the events after it). A journal written before they existed (the
    same events without "g") replays the very same stop state, and its audits are simply not in
    the give-up risk (n = 0), not counted at some invented loss."""
    monkeypatch.setattr("orca_serve.live_audit.state.SNAPSHOT_EVERY", 50)
    audit = _two_sided(tmp_path / "new")
    rng = np.random.default_rng(9)
    for _ in range(60):
        labels = [0, 1, 1] if rng.random() < 0.3 else [1, 1, 1]
        g = [0.0, 0.0, 0.0] if rng.random() < 0.5 else [0.9, 0.9, 0.9]
        audit.observe([0.99, 0.99, 0.99], labels, censored=bool(rng.random() < 0.1), give_up=g)
    table = audit.table()
    assert any(r["engaged"] for r in table["give_up"]["deltas"])
    path = audit.state.journal.path
    audit.state.journal.close()
    again = _two_sided(tmp_path / "new")
    assert again.state.replayed == 120 - 100  # a snapshot after 100 events, then the rest
    assert again.table()["give_up"] == table["give_up"]
    assert again.table()["deltas"] == table["deltas"]
    again.state.journal.close()
    old = tmp_path / "old" / path.name
    old.parent.mkdir()
    events = [json.loads(x) for x in path.read_text().splitlines()]
    assert sum("g" in e for e in events) == 60
    old.write_text("".join(json.dumps({k: v for k, v in e.items() if k != "g"}) + "\n"
                           for e in events))
    replayed = _two_sided(tmp_path / "old")
    assert replayed.table()["deltas"] == table["deltas"]
    assert all(r["n"] == 0 and r["mu_source"] == "bundle"
               for r in replayed.table()["give_up"]["deltas"])
    replayed.state.journal.close()


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


@pytest.mark.parametrize("regrowth", ["at_a_line_end", "mid_line"])
def test_a_stale_snapshot_is_not_restored(regrowth, tmp_path, monkeypatch):
    """The journal loses its tail below the snapshot's offset (a power cut kept the snapshot
    but not the last lines: an audit with loss 1), and a restart then journals a replacement
    audit (loss 0) that makes it grow past the offset again. The next restart must not
    restore the snapshot: at a line end it would fold the dead audit's loss in place of its
    replacement's, mid-line it would read from the middle of a line (a JSONDecodeError that
    stopped every later start). It replays the whole journal: the state of the events the
    journal holds, the replacement's included, and a fresh snapshot from then on is used."""
    monkeypatch.setattr("orca_serve.live_audit.state.SNAPSHOT_EVERY", 50)
    first = _attached(tmp_path)
    for _ in range(24):
        first.observe(*known_loss(False))
    first.observe(*known_loss(True))  # events 49, 50: the snapshot covers them
    path, snap = first.state.journal.path, first.state.journal.snapshot_path
    offset = json.loads(snap.read_text())["offset"]
    assert offset == path.stat().st_size
    first.state.journal.close()
    lines = _lines(path)
    path.write_bytes(b"".join(lines[:-2]))  # the dead audit's two lines are lost
    second = _attached(tmp_path)  # the offset is beyond the file: replayed whole
    assert second.state.replayed == 48 and second.state.guard(DELTA).cs.n == 24
    if regrowth == "mid_line":
        second.observe(*known_loss(False), censored=True)  # a shorter outcome line first
    second.observe(*known_loss(False))
    second.state.journal.close()
    size = path.stat().st_size
    at_line_end = path.read_bytes()[offset - 1:offset] == b"\n"
    assert size >= offset and at_line_end == (regrowth == "at_a_line_end")
    third = _attached(tmp_path)
    g = third.state.guard(DELTA)
    assert third.state.replayed == len(_lines(path)) - 1  # every event, not those after the offset
    assert g.cs.n == 25 + (regrowth == "mid_line") and g.cs.mean == 0.0  # no loss of the dead
    expect = third.table()["deltas"]
    for _ in range(30):  # a snapshot of this journal again, and it is used
        third.observe(*known_loss(False))
    third.state.journal.close()
    fourth = _attached(tmp_path)
    assert 0 < fourth.state.replayed < 40 and fourth.state.guard(DELTA).cs.n == g.cs.n
    assert expect[0]["n"] == 25 + (regrowth == "mid_line")
    fourth.state.journal.close()


def test_a_torn_tail_longer_than_a_chunk_cuts_only_that_line(tmp_path):
    """A torn last line of more than 1 MiB (a crash while writing one huge event) is cut, and
    only it: the 200 audits before it stay (the repair once read only the last MiB and, not
    finding a newline there, cut the whole journal)."""
    audit = _attached(tmp_path)
    for _ in range(200):
        audit.observe(*known_loss(False))
    audit.state.journal.close()
    path = journal_path(tmp_path, bundle().checksum)
    whole = path.read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"r": 201, "o": "risk", "s": [' + b"0.5, " * 400_000)  # 2 MB, no newline
    again = _attached(tmp_path)
    assert path.read_bytes() == whole
    assert again.state.replayed == 400 and again.state.guard(DELTA).cs.n == 200
    again.state.journal.close()


def test_a_corrupt_line_is_skipped_with_a_warning_and_counted(tmp_path, caplog):
    """A complete line that is not an event (garbage, or JSON that is no event) does not stop
    `attach`: it is skipped with a warning, counted in the table, and the other events fold as
    before; an outcome skipped leaves its audit open, reaped as lost once its process is
    gone, and an admission skipped is admitted by its outcome's number. A corrupt header is
    refused in one clear line."""
    audit = _attached(tmp_path)
    for _ in range(10):
        audit.observe(*known_loss(False))
    audit.state.journal.close()
    path = journal_path(tmp_path, bundle().checksum)
    lines = _lines(path)
    assert json.loads(lines[4])["o"] == "risk"  # the outcome of audit 2
    lines[4] = b'{"r": 2, "o": "ri\x00\x00\x00\n'
    lines[8] = b'{"r": 4, "o": "risk"}\n'  # JSON, but no scores: not an event either
    path.write_bytes(b"".join(lines))
    with caplog.at_level("WARNING", logger="orca_serve.live_audit"):
        again = _attached(tmp_path)
    assert sum("corrupt event" in r.getMessage() for r in caplog.records) == 2
    table = again.table()
    assert table["journal_skipped"] == 2 and table["lost"] == 2 and table["open"] == 0
    assert again.state.guard(DELTA).cs.n == 8 and again.state.admitted == 10
    again.state.journal.close()
    assert json.loads(lines[5]) == {"a": json.loads(lines[1])["a"]}  # audit 3's admission
    lines[5] = b"\x00" * (len(lines[5]) - 1) + b"\n"
    path.write_bytes(b"".join(lines))
    # an admission skipped: its outcome's number admits it, and the numbers after it hold
    # (before, each later outcome named an admission number one too high: all were dropped)
    healed = _attached(tmp_path)
    assert healed.table()["journal_skipped"] == 3 and healed.state.admitted == 10
    assert healed.table()["open"] == 0 and healed.state.guard(DELTA).cs.n == 8
    healed.state.journal.close()
    lines[0] = b"\x00\x00garbage\n"
    path.write_bytes(b"".join(lines))
    with pytest.raises(ValueError, match="not an audit journal header"):
        _journal(tmp_path)


def test_a_journal_cut_shorter_is_left_for_the_guard_in_memory(tmp_path):
    """A journal truncated below what a process applied (a copytruncate, a restore from a copy)
    made every orca request and GET /v1/orca/audit fail ([Errno 22]: a read of a negative
    length): the process now goes on in memory from the state it folded."""
    from orca_serve.live_audit.journal import LocalFallback, MemoryJournal

    j = LocalFallback(_journal(tmp_path))
    from orca_serve.live_audit.fleet import store_metrics

    assert store_metrics(j, "m")[0].samples[0].value == 1.0
    for k in range(5):
        j.append({"a": k})
    path = journal_path(tmp_path, bundle().checksum)
    os.truncate(path, path.stat().st_size // 2)
    assert j.read() == [] and isinstance(j.journal, MemoryJournal) and j.down_since is not None
    assert j.append({"a": 5}) == [{"a": 5}] and j.path == MemoryJournal.path
    assert j.owner == j.journal.owner  # the same owner: its open admissions stay its own
    from orca_serve.live_audit.fleet import store_metrics

    [up] = store_metrics(j, "m")  # said in /metrics too
    assert up.name == "orca_audit_journal_up" and up.samples[0].value == 0.0


def test_a_line_the_disk_does_not_take_whole_is_not_applied_as_journalled(tmp_path,
                                                                          monkeypatch):
    """A full disk took half a line while the guards applied the event (the journal ended in
    `{"r":25,"o":"o` with n 26 in memory): the process leaves the file for memory, and a
    process attaching later cuts the half line and replays what the file holds."""
    from orca_serve.live_audit import journal as journal_module
    from orca_serve.live_audit.journal import LocalFallback, MemoryJournal

    j = LocalFallback(_journal(tmp_path))
    j.append({"a": 0})
    real = os.write
    with monkeypatch.context() as m:
        m.setattr(journal_module.os, "write", lambda fd, data: real(fd, data[:len(data) // 2]))
        assert j.append({"a": 1}) == [{"a": 1}]  # applied: in memory from here on
    assert isinstance(j.journal, MemoryJournal)
    again = _journal(tmp_path)  # the next process: the torn line is cut, {"a": 1} not in it
    assert [e for e in again.read()] == [{"a": 0}]
