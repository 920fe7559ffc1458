"""The audit's state on disk: an append-only journal of admissions and outcomes, per bundle.

The guards' state (the alarm's members, engaged or not, the recalibration count k, the
recalibrated lambda and its own audit, the window a wait collects) is a deterministic function
of the ordered stream of audit events: an audit admitted (its admission number), and an audit
resolved (its scores and labels when it entered the risk, `censored` when it was cut or
aborted, left out otherwise). So the journal keeps those events and every process folds them
into the same state (`LiveAudit._apply`), in file order:

    DIR/guard-<first 16 hex of the bundle checksum>.jsonl
    {"v": 1, "bundle_checksum": "...", "created": 1764150000.0}   the header
    {"a": 17}                                                       audit 17 admitted
    {"r": 17, "o": "risk", "s": [...], "l": [...]}                  audit 17 resolved
    {"r": 18, "o": "out", "g": [...]}                               a two-sided bundle's audit:
                                                                    "g" its give-up scores (null:
                                                                    censored); no "g" (journals
                                                                    before it): not in that risk
    {"r": 19, "o": "censored", "s": [...], "l": [...], "c": "length"}  cut by max_tokens ("c":
                                                                    why; journals before it:
                                                                    none, read as aborted)
    {"x": "drift", "d": null, "k": null}                            the sequential drift test
                                                                    alarmed (the bundle's,
                                                                    folded only with
                                                                    --orca-audit-drift-acts;
                                                                    "d", "k": a delta's k-th
                                                                    recalibrated lambda's)
    {"vote": [0.1, 0.05], "l": 1.0}                                 an audited voted group of
                                                                    the consensus row (delta
                                                                    0.1, delta_vote 0.05): its
                                                                    vote error (null: censored;
                                                                    live_audit/votes.py)

- **Restarts**: a server that starts with the same bundle and directory replays the journal and
  carries on where the last one stopped, so the alarm's levels are spent once per bundle, not
  once per process, and a lambda that alarmed stays alarmed.
- **Several processes** on one machine that share the directory (two servers, or a server and
  its successor during a rolling restart) share one journal: every append takes an exclusive
  `flock`, first reads what the others appended (the caller applies it before its own event),
  so all processes see one order and one state. Readers take a shared lock.
- **Crash safety**: one event is one line, written with one `write` under the lock (outcomes
  fsynced, about 5 ms here; admissions not: see `append`), so a killed process leaves at most
  a torn last line; the next process that opens or appends cuts it off (it was never applied
  by anyone: readers only take complete lines), however long it is. An
  outcome is journalled before the labelled audit's record is written to the trajectory
  directory, so a crash between the two loses the record's embeddings, never the audit's
  place in the statistics.
- **Corrupt lines**: a complete line that is not an event (a disk or a file system that lost
  or mangled data: a power cut can leave zeros where a line was) is skipped by every reader
  alike, with a warning, and counted (`skipped`, the table's `journal_skipped`). Refusing to
  start would stop the server for good; skipping loses at most what a crash loses: an
  outcome skipped leaves its audit open, reaped as `lost` once its process is gone; an
  admission skipped is known from its outcome, whose number is beyond the admissions folded
  so far: the fold admits the missing numbers then (`AuditState._apply`), so the numbers
  after it stay the writers' and its outcome counts (a missing number whose outcome never
  comes is reaped as `lost`). What is lost does not depend on the audit's loss (corruption
  does not read it), so the bounds stay valid for the audits they hold, as after a crash. A
  corrupt header is refused (it tells which bundle the journal is for).
- **Snapshots**: replaying costs about a millisecond per event and delta, so every
  `SNAPSHOT_EVERY` events the process that applied them writes the folded state with the
  journal offset it covers and the SHA-256 of the journal's bytes up to it to
  `guard-<...>.snapshot.json` (the journal fsynced first, so the snapshot never covers bytes
  the disk may not keep; then a temporary file, fsynced, renamed over the old one: a crash
  leaves the old snapshot or the new one, never a torn one). A process that attaches restores
  the snapshot when it was folded under the same settings and the journal still holds those
  very bytes, and replays only the events after it; otherwise (the journal lost its tail below
  the offset and grew again, or was replaced) it replays the whole journal, so it never folds
  an event the journal no longer holds nor starts reading in the middle of a line.
- **Abandoned audits**: an admission that a crashed process never resolved would keep a
  recalibration window waiting for ever. Each process holds an `flock` on
  `DIR/guard-owners/<owner>.lock` while it lives and tags its admissions with `owner`; a
  process that finds an unresolved admission whose owner's lock is free (that process is gone)
  journals it as `lost` (`LiveAudit.reap`).

- **Settings**: the processes that fold one journal at the same time must fold it under the
  same settings (the flags of `orca_serve.live_audit.options.fold_flags`, and the fold itself:
  its `FOLD_FORMAT`, which another orca-serve version may fold by), or their decisions differ
  on the same events. The first one to attach records them with its owner
  (`DIR/guard-<...>.fold.json`, under the journal's lock; `joined`); a later one whose settings
  differ while a process recorded there still runs is refused (`FoldSettingsDiffer`, naming each
  flag, or both formats). Once all of them are gone the next one records its own: a restart
  with other flags replays the journal under them ("Snapshots" above). A record that cannot be
  read (`fold_record`) is refused too while another process runs, since the settings they fold
  under are then unknown; when none runs it is written anew.

- **A file that fails**: a journal shorter than what this process applied (truncated, restored
  from a copy) or that cannot take a whole line (a full disk) no longer holds what the guards
  folded, so the process leaves it (`JournalLost`, `LocalFallback`): its guard goes on in
  memory from the state folded so far, said once in the log, until a restart attaches anew.
  Before, a shorter file failed every request, and a full disk kept half lines of events the
  guards had applied.

`EventJournal` is what `LiveAudit` needs of a journal; this file journal is the embedded
default (it needs nothing but the audit directory). A fleet on several machines shares one
through a store (`--orca-audit-store`, orca_serve/live_audit/fleet.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

VERSION = 1
OWNERS = "guard-owners"
SNAPSHOT_EVERY = 500  # events between two snapshots of the folded state
_CHUNK = 1 << 20  # bytes read at a time when the journal is scanned (repair, digest)

logger = logging.getLogger("orca_serve.live_audit")


class AuditOutcome(StrEnum):
    """What became of an admitted audit: an outcome event's "o" (the module docstring). Members
    compare equal to the journal's words, so journals written before the enum read the same."""

    RISK = "risk"  # labelled to its end: in the risk with its scores and labels
    CENSORED = "censored"  # cut by max_tokens or aborted: in the risk, loss unknown past the cut
    OUT = "out"  # left out of the risk (failed, dropped, never right, unaligned)
    LOST = "lost"  # its process died before its outcome (reaped)


DRIFT = "drift"  # a sequential drift alarm event's "x" (the module docstring)


def is_drift(e: dict[str, Any]) -> bool:
    """Whether an event is a sequential drift test's alarm."""
    return e.get("x") == DRIFT


VOTE = "vote"  # an audited voted group's event: its consensus row (the module docstring)


def vote_event(delta: float, delta_vote: float, loss: float | None) -> dict[str, Any]:
    """The event of an audited voted group of the consensus row (delta, delta_vote): its vote
    loss, None when censored (orca_serve/live_audit/votes.py)."""
    return {VOTE: [delta, delta_vote], "l": loss}


def is_vote(e: dict[str, Any]) -> bool:
    """Whether an event is an audited voted group's."""
    return VOTE in e


class JournalRefused(ValueError):
    """This process must not take part in the journal it opened, for a reason one line says (what
    differs, or which key holds what): its start is refused (orca_serve/startup/cli.py) or its
    hot reload (orca_serve/api_server/reload.py), never turned into a guard of its own."""


class FoldSettingsDiffer(JournalRefused):
    """Processes that fold a journal now fold it under other settings than this one's (flags,
    or the fold's format), or under settings that cannot be read: it must not join them, since
    on the same events its decisions would (or could) differ from theirs."""


# The fold format of a record that names none: every version that wrote fold records before
# they carried one folds as FOLD_FORMAT 1 (orca_serve/live_audit/options.py) does.
UNRECORDED_FORMAT = 1


def _is_fold_record(record: Any) -> bool:
    """Whether a parsed fold record has the shape `joined` writes (a format, from 1 on, or none:
    `UNRECORDED_FORMAT`)."""
    if not isinstance(record, dict):
        return False
    fmt = record.get("format", UNRECORDED_FORMAT)
    members = record.get("members")
    return (isinstance(fmt, int) and not isinstance(fmt, bool) and fmt >= 1
            and isinstance(record.get("settings"), dict) and isinstance(members, list)
            and all(isinstance(m, str) for m in members))


def fold_record(raw: str | bytes | None, at: Any, others_run: Callable[[], bool]
                ) -> dict[str, Any] | None:
    """The fold record stored at `at` (`raw`; None: none yet) for `joined`. One that cannot be
    read (not JSON, or not a record's shape: edited by hand, cut short, another value under its
    key) is refused with `FoldSettingsDiffer` while a process other than this one may run
    (`others_run`): the settings it folds under are unknown, and written anew with this one's
    they could differ from its own (before, the newcomer took the record over silently). When
    none runs it names nobody's settings, so it is logged and written anew (None)."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    if _is_fold_record(record):
        return record
    shown = raw[:60]
    if others_run():
        raise FoldSettingsDiffer(
            f"{at}: not a fold record ({shown!r}), so the settings that running processes fold "
            "these audit events under are unknown; stop them all, delete it, and start them "
            "again")
    logger.warning("orca audit: %s was not a fold record (%r); no other process runs, so it is "
                   "written anew with this one's settings", at, shown)
    return None


def _shown(value: Any) -> str:
    """A setting's value as the refusal names it: a switch on or off; None, a flag the fold
    does not read under the other settings (`fold_flags`)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unused" if value is None else str(value)


def joined(record: dict[str, Any] | None, settings: dict[str, Any], fold_format: int,
           owner: str, alive: Callable[[str], bool], where: Any,
           lingers: float = 0.0) -> dict[str, Any]:
    """A journal's fold record (`{"format", "settings", "members"}`: how its processes fold,
    and which processes joined; `record`, read by `fold_record`) once `owner` joins it under
    `settings` and `fold_format`. The members that still run (`alive`) must fold by the same
    format (another version's fold: refused, both formats named) and hold the same settings,
    else `FoldSettingsDiffer` names each differing one with both values; when none runs (the
    first process, or all stopped to change a flag or the version) this one's become the
    journal's. The dead are dropped, so the record stays small. `lingers`: seconds a process
    that crashed still counts as running (a store's owner key expiring), said in the refusal:
    an operator who finds none of them running must know to wait, not look for a process that
    is gone."""
    members = [m for m in record["members"] if alive(m)] if record is not None else []
    crashed = (f" (one that crashed counts as running until its owner key expires, {lingers:g} s)"
               if lingers else "")
    theirs_format = record.get("format", UNRECORDED_FORMAT) if record is not None else None
    if members and theirs_format != fold_format:
        raise FoldSettingsDiffer(
            f"{where}: {len(members)} running process(es) fold these audit events by fold "
            f"format {theirs_format}, this one by format {fold_format} (another orca-serve "
            "version, whose fold decides otherwise on the same events); stop them all to "
            f"change versions{crashed}")
    theirs = record["settings"] if record is not None else {}
    if members and theirs != settings:
        diff = "; ".join(f"{k} {_shown(theirs.get(k))} there, {_shown(settings.get(k))} here"
                         for k in dict.fromkeys([*settings, *theirs])
                         if theirs.get(k) != settings.get(k))
        raise FoldSettingsDiffer(
            f"{where}: {len(members)} running process(es) fold these audit events under "
            f"other settings ({diff}); give this one theirs, or stop them all to change "
            f"them{crashed}")
    return {"format": fold_format, "settings": settings, "members": [*members, owner]}


class EventJournal(Protocol):
    """One bundle's ordered stream of audit events, shared by every process that opens it.

    The contract `LiveAudit` folds (`attach`, `_event`, `sync`, `reap`): all processes see
    one total order of the events, and `append` hands back, in that order, what the others
    appended since this process last read, then the event itself."""

    owner: str  # tags this process's admissions; `alive` tells whether it still runs
    skipped: int  # corrupt events skipped so far (`parse_events`)

    @property
    def path(self) -> Any:
        """Where the events live (a file, or a store's key), for the log and the table."""

    def join(self, settings: dict[str, Any], fold_format: int) -> None:
        """Fold the journal under `settings` and `fold_format` beside the processes that fold it
        now, or raise `FoldSettingsDiffer` (theirs differ, or their record cannot be read:
        `joined`, `fold_record`); before the first read."""

    def read(self) -> list[dict[str, Any]]:
        """Events appended by anyone since this process last read (cheap when none were)."""

    def append(self, event: dict[str, Any], durable: bool = True) -> list[dict[str, Any]]:
        """Append one event; the events the others appended before it, then it."""

    def read_snapshot(self) -> dict[str, Any] | None:
        """The latest snapshot's state, the read position moved to it; None when unusable."""

    def write_snapshot(self, state: dict[str, Any]) -> None:
        """Save the state folded from the events up to the read position."""

    def rewind(self) -> None:
        """Read from the first event again (a snapshot that could not be used)."""

    def alive(self, owner: str) -> bool:
        """Whether the process that tagged admissions with `owner` still runs."""

    def close(self) -> None:
        """Stop taking part (this process's open admissions become reapable)."""


def snapshot_json(checksum: str, created: Any, offset: int, digest: str,
                  state: dict[str, Any]) -> str:
    """A snapshot as every backend stores it: the folded state, the event offset it covers, and
    what `read_snapshot_json` checks it against (the bundle, the journal's creation, the
    journal's digest up to the offset)."""
    return json.dumps({"v": VERSION, "bundle_checksum": checksum, "created": created,
                       "offset": offset, "digest": digest, "state": state},
                      separators=(",", ":"))


def read_snapshot_json(raw: str | bytes | None, checksum: str, created: Any, length: int,
                       digest: Callable[[int], str]) -> tuple[int, dict[str, Any]] | None:
    """A stored snapshot's (offset, state), or None when there is none, it is unreadable, or it
    is not this journal's: of another bundle, or of a journal created anew under the same name;
    covering more than the journal's `length` holds; or the journal no longer holds what it
    covered: `digest(offset)`, the journal's digest of its events up to the offset now, differs
    from the one the snapshot was written with (a tail lost below the offset and grown again, or
    a snapshot of before that digest existed). The caller then replays the journal whole."""
    try:
        snap = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(snap, dict) or (snap.get("bundle_checksum"), snap.get("created")) != (
            checksum, created):
        return None
    offset = snap.get("offset")
    if not isinstance(offset, int) or not 0 < offset <= length:
        return None
    return (offset, snap["state"]) if snap.get("digest") == digest(offset) else None


def _is_event(e: Any) -> bool:
    """Whether a parsed line is something the fold can apply: the header, an admission, a
    sequential drift alarm, an audited voted group's loss, or an outcome (a `risk` one with its
    scores and labels)."""
    if not isinstance(e, dict):
        return False
    if "v" in e or "a" in e:
        return True
    if is_vote(e):
        row, loss = e[VOTE], e.get("l")
        return (isinstance(row, list) and len(row) == 2
                and all(isinstance(x, (int, float)) for x in row)
                and (loss is None or isinstance(loss, (int, float))))
    if is_drift(e):
        return (e.get("d") is None or isinstance(e["d"], (int, float))) and (
            e.get("k") is None or isinstance(e["k"], int))
    return (isinstance(e.get("r"), int) and isinstance(e.get("o"), str)
            and (e["o"] != AuditOutcome.RISK or (isinstance(e.get("s"), list)
                                      and isinstance(e.get("l"), list))))


def parse_events(raw: Iterable[bytes], where: Any) -> tuple[list[dict[str, Any]], int]:
    """The events of complete journal lines (or store elements), and how many were skipped as
    corrupt (`_is_event`): the rule every reader applies alike (module docstring,
    "Corrupt lines"), each skip logged."""
    events, skipped = [], 0
    for line in raw:
        try:
            e = json.loads(line)
        except ValueError:
            e = None
        if _is_event(e):
            events.append(e)
            continue
        skipped += 1
        logger.warning("orca audit: skipped a corrupt event in %s (%d bytes: %r...); it counts "
                       "as lost", where, len(line), bytes(line[:40]))
    return events, skipped


class JournalLost(OSError):
    """A journal that no longer holds the events this process applied, or cannot take one: the
    process leaves it (`LocalFallback`)."""


class MemoryJournal:
    """This process's own events, in memory: the guard when no journal holds them (none set,
    or the one it had was lost). Alone, so nothing precedes its appends, and only its own owner
    is alive (another process's audit that was open in the journal never resolves here: it is
    reaped as lost)."""

    path = "memory (this process only)"
    skipped = 0  # nothing is read back, so nothing is ever corrupt

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def join(self, settings: dict[str, Any], fold_format: int) -> None:
        pass  # alone: no other process folds these events

    def read(self) -> list[dict[str, Any]]:
        return []

    def append(self, event: dict[str, Any], durable: bool = True) -> list[dict[str, Any]]:
        return [event]

    def read_snapshot(self) -> dict[str, Any] | None:
        return None

    def write_snapshot(self, state: dict[str, Any]) -> None:
        pass  # the state is this process's; nothing outlives it

    def rewind(self) -> None:
        pass

    def alive(self, owner: str) -> bool:
        return owner == self.owner

    def close(self) -> None:
        pass


class LocalFallback:
    """A journal this process leaves for its own guard in memory (`MemoryJournal`, the same
    owner, the state folded so far) once it fails for good (`lost_on`); said once in the log.
    It does not go back before a restart: what the guard in memory decided cannot be put into
    the journal's order after the fact (orca_serve/live_audit/fleet.py says why for a store)."""

    lost_on: tuple[type[Exception], ...] = (JournalLost,)

    def __init__(self, journal: EventJournal) -> None:
        self.journal = journal
        self.down_since: float | None = None

    @property
    def owner(self) -> str:
        return self.journal.owner

    @property
    def path(self) -> Any:
        return self.journal.path

    @property
    def skipped(self) -> int:
        return self.journal.skipped

    def lost(self, e: Exception, when: str, left: Any) -> None:
        """Say that the journal at `left` was left (`when`: at start, while serving);
        `down_since` is the first journal's leaving."""
        self.down_since = self.down_since or time.time()
        logger.warning("orca audit: the audit journal %s failed %s (%s); this process goes on "
                       "with its own guard in memory until it restarts", left, when, e)

    def _try(self, call: str, *args: Any) -> Any:
        try:
            return getattr(self.journal, call)(*args)
        except self.lost_on as e:
            if isinstance(self.journal, MemoryJournal):
                raise
            old, self.journal = self.journal, MemoryJournal(self.journal.owner)
            old.close()
            self.lost(e, "while serving", old.path)
        return getattr(self.journal, call)(*args)

    def join(self, settings: dict[str, Any], fold_format: int) -> None:
        self._try("join", settings, fold_format)

    def read(self) -> list[dict[str, Any]]:
        return self._try("read")

    def append(self, event: dict[str, Any], durable: bool = True) -> list[dict[str, Any]]:
        return self._try("append", event, durable)

    def read_snapshot(self) -> dict[str, Any] | None:
        return self._try("read_snapshot")

    def write_snapshot(self, state: dict[str, Any]) -> None:
        self._try("write_snapshot", state)

    def rewind(self) -> None:
        self.journal.rewind()

    def alive(self, owner: str) -> bool:
        return self._try("alive", owner)

    def close(self) -> None:
        self.journal.close()


def journal_path(directory: Path, checksum: str) -> Path:
    """Where the journal of the bundle with this checksum lives in an audit directory."""
    return Path(directory) / f"guard-{checksum[:16]}.jsonl"


class Journal:
    """One bundle's event journal (see the module docstring); one instance per process."""

    def __init__(self, path: Path, checksum: str, *, fsync: bool = True,
                 ours: Iterable[str] = ()) -> None:
        """`ours`: the owners of this process's other journals (a hot reload's retiring audit,
        open until the swap), which `_others_run` does not count as another process."""
        self.path = Path(path)
        self.checksum = checksum
        self.fsync = fsync
        self.owner = uuid.uuid4().hex[:12]
        self._ours = frozenset([self.owner, *ours])
        self._offset = 0  # bytes of the file this process has read (complete lines only)
        self._digest = hashlib.sha256()  # of the bytes up to _offset (a snapshot's check)
        self.skipped = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        owners = self.path.parent / OWNERS
        owners.mkdir(exist_ok=True)
        self._owner_file = open(owners / f"{self.owner}.lock", "w")  # noqa: SIM115 - held for life
        self._fd = -1
        try:
            fcntl.flock(self._owner_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            with self._locked(fcntl.LOCK_EX):
                self._repair()
                if os.fstat(self._fd).st_size == 0:
                    self._write({"v": VERSION, "bundle_checksum": checksum,
                                 "created": time.time()})
            header = self._header()
            if header.get("bundle_checksum") != checksum:
                raise ValueError(f"{self.path} is the audit journal of another bundle "
                                 f"({header.get('bundle_checksum')!r}); move it away")
        except BaseException:  # refused (a hot reload is retried): holds nothing
            self.close()
            raise
        self.created = header.get("created")  # tells this journal from a recreated one

    def _header(self) -> dict[str, Any]:
        """The first line, which says whose journal this is; unreadable: refused."""
        first = os.pread(self._fd, _CHUNK, 0).split(b"\n", 1)[0]
        try:
            header = json.loads(first)
        except ValueError:
            header = None
        if not isinstance(header, dict) or "v" not in header:
            raise ValueError(f"{self.path}: its first line is not an audit journal header "
                             f"({first[:60]!r}); move the file away")
        return header

    @contextmanager
    def _locked(self, how: int) -> Iterator[None]:
        fcntl.flock(self._fd, how)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _repair(self) -> None:
        """Cut a torn last line (a process died in the middle of writing it), only that line,
        however long; under LOCK_EX."""
        size = os.fstat(self._fd).st_size
        if size == 0 or os.pread(self._fd, 1, size - 1) == b"\n":
            return
        end = size - 1  # the torn line's last byte; look for the newline before it
        while end > 0:
            start = max(0, end - _CHUNK)
            cut = os.pread(self._fd, end - start, start).rfind(b"\n")
            if cut >= 0:
                os.ftruncate(self._fd, start + cut + 1)
                return
            end = start
        os.ftruncate(self._fd, 0)  # the header itself was torn: nothing was ever journalled

    def _write(self, event: dict[str, Any], durable: bool = True) -> None:
        """One line, whole, or `JournalLost` (a half line is cut by the next `_repair`)."""
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        try:
            written = os.write(self._fd, line)
            if self.fsync and durable:
                os.fsync(self._fd)
        except OSError as e:
            raise JournalLost(f"{self.path}: {e.strerror or e}") from e
        if written != len(line):
            raise JournalLost(f"{self.path}: {written} of {len(line)} bytes written (a full "
                              "disk?)")

    def _lines(self) -> list[dict[str, Any]]:
        """The events of the complete lines after this process's offset (advancing it, and
        the digest with it); corrupt ones skipped (`parse_events`). A file now shorter than
        that offset lost events this process applied: `JournalLost`."""
        size = os.fstat(self._fd).st_size
        if size < self._offset:
            raise JournalLost(f"{self.path} is {size} bytes, shorter than the {self._offset} "
                              "this process applied (truncated, or restored from a copy)")
        data = os.pread(self._fd, size - self._offset, self._offset)
        end = data.rfind(b"\n") + 1
        if end == 0:
            return []
        self._offset += end
        self._digest.update(data[:end])
        events, skipped = parse_events(data[:end].splitlines(), self.path)
        self.skipped += skipped
        return events

    def read(self) -> list[dict[str, Any]]:
        """Events appended (by any process) since this process last read; the header skipped.
        Nothing new (the common case, on every request): one fstat, no lock."""
        if os.fstat(self._fd).st_size == self._offset:
            return []
        with self._locked(fcntl.LOCK_SH):
            return [e for e in self._lines() if "v" not in e]

    def append(self, event: dict[str, Any], durable: bool = True) -> list[dict[str, Any]]:
        """Append one event; returns the events the others appended before it, then it, in file
        order (the caller applies them in that order). `durable=False` skips the fsync (an
        admission: lost in a power cut only together with its unfinished audit, since the fsync
        of any later outcome makes every line before it durable too)."""
        with self._locked(fcntl.LOCK_EX):
            self._repair()
            before = [e for e in self._lines() if "v" not in e]
            self._write(event, durable)
            self._lines()  # our own line: read past it
        return [*before, event]

    @property
    def offset(self) -> int:
        """Bytes of the journal this process has applied (complete lines)."""
        return self._offset

    @property
    def snapshot_path(self) -> Path:
        return self.path.with_suffix(".snapshot.json")

    @property
    def fold_path(self) -> Path:
        """The fold record (`joined`: the settings its running processes fold under)."""
        return self.path.with_suffix(".fold.json")

    def _replace(self, path: Path, text: str) -> None:
        """Write `path` whole or not at all: a temporary file, fsynced, renamed over it."""
        tmp = self.path.parent / f".{self.path.stem}.{self.owner}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def join(self, settings: dict[str, Any], fold_format: int) -> None:
        """Record this process in the fold record under `settings` and `fold_format`, or
        `FoldSettingsDiffer` (`fold_record`, `joined`); under the journal's exclusive lock, so
        two that start at once agree."""
        with self._locked(fcntl.LOCK_EX):
            try:
                raw = self.fold_path.read_bytes()
            except FileNotFoundError:
                raw = None  # none yet
            record = fold_record(raw, self.fold_path, self._others_run)
            self._replace(self.fold_path, json.dumps(
                joined(record, settings, fold_format, self.owner, self.alive, self.path)))

    def _others_run(self) -> bool:
        """Whether a process other than this one holds an owner lock in the directory: one that
        may fold this journal (a lock does not say which bundle's journal its process folds).
        This process's own (`ours`) fold other bundles' journals, under its settings."""
        return any(self.alive(p.stem) for p in (self.path.parent / OWNERS).glob("*.lock")
                   if p.stem not in self._ours)

    def write_snapshot(self, state: dict[str, Any]) -> None:
        """Save the state folded from the journal up to `offset` (atomically, see above)."""
        if self.fsync:  # the admissions it covers (not fsynced when appended) reach the disk
            os.fsync(self._fd)
        self._replace(self.snapshot_path, snapshot_json(
            self.checksum, self.created, self._offset, self._digest.hexdigest(), state))

    def read_snapshot(self) -> dict[str, Any] | None:
        """The latest snapshot's state, positioned at its offset; None when there is none,
        it is unreadable, or it is not this journal's (the caller then replays it all)."""
        try:
            raw = self.snapshot_path.read_text()
        except OSError:
            return None
        digests: dict[int, Any] = {}

        def digest(offset: int) -> str:
            digests[offset] = self._prefix_digest(offset)
            return digests[offset].hexdigest()

        with self._locked(fcntl.LOCK_SH):
            found = read_snapshot_json(raw, self.checksum, self.created,
                                       os.fstat(self._fd).st_size, digest)
        if found is None:
            logger.info("orca audit: the snapshot %s does not match %s; replaying it whole",
                        self.snapshot_path, self.path)
            return None
        offset, state = found
        self._offset, self._digest = offset, digests[offset]
        return state

    def _prefix_digest(self, offset: int) -> Any:
        """SHA-256 of the journal's first `offset` bytes (a hashlib object, to go on with)."""
        h = hashlib.sha256()
        pos = 0
        while pos < offset:
            chunk = os.pread(self._fd, min(_CHUNK, offset - pos), pos)
            if not chunk:
                break
            h.update(chunk)
            pos += len(chunk)
        return h

    def rewind(self) -> None:
        """Read the journal from its start again (a snapshot that could not be used)."""
        self._offset, self._digest, self.skipped = 0, hashlib.sha256(), 0

    def alive(self, owner: str) -> bool:
        """Whether the process that tagged events with `owner` still holds its lock."""
        if owner == self.owner:
            return True
        path = self.path.parent / OWNERS / f"{owner}.lock"
        try:
            with open(path, "a") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return True
                fcntl.flock(f, fcntl.LOCK_UN)
        except OSError:
            return False
        path.unlink(missing_ok=True)  # that process is gone; its lock file served its purpose
        return False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if not self._owner_file.closed:
            (self.path.parent / OWNERS / f"{self.owner}.lock").unlink(missing_ok=True)
            self._owner_file.close()
