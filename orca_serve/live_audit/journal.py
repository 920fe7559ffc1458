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
  by anyone: readers only take complete lines). An
  outcome is journalled before the labelled audit's record is written to the trajectory
  directory, so a crash between the two loses the record's embeddings, never the audit's
  place in the statistics.
- **Snapshots**: replaying costs about a millisecond per event and delta, so every
  `SNAPSHOT_EVERY` events the process that applied them writes the folded state with the
  journal offset it covers to `guard-<...>.snapshot.json` (a temporary file, fsynced, then
  renamed over the old one: a crash leaves the old snapshot or the new one, never a torn one).
  A process that attaches restores the snapshot when it was folded under the same settings and
  replays only the events after it.
- **Abandoned audits**: an admission that a crashed process never resolved would keep a
  recalibration window waiting for ever. Each process holds an `flock` on
  `DIR/guard-owners/<owner>.lock` while it lives and tags its admissions with `owner`; a
  process that finds an unresolved admission whose owner's lock is free (that process is gone)
  journals it as `lost` (`LiveAudit.reap`).

`EventJournal` is what `LiveAudit` needs of a journal; this file journal is the embedded
default (it needs nothing but the audit directory). A fleet on several machines shares one
through a store (`--orca-audit-store`, orca_serve/live_audit/fleet.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

VERSION = 1
OWNERS = "guard-owners"
SNAPSHOT_EVERY = 500  # events between two snapshots of the folded state


class EventJournal(Protocol):
    """One bundle's ordered stream of audit events, shared by every process that opens it.

    The contract `LiveAudit` folds (`attach`, `_event`, `sync`, `reap`): all processes see
    one total order of the events, and `append` hands back, in that order, what the others
    appended since this process last read, then the event itself."""

    owner: str  # tags this process's admissions; `alive` tells whether it still runs

    @property
    def path(self) -> Any:
        """Where the events live (a file, or a store's key), for the log and the table."""

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


def snapshot_offset(snap: Any, checksum: str, created: float, length: int) -> int | None:
    """The event offset a snapshot covers, or None when it is not this journal's (another
    bundle, or a journal created anew under the same name) or covers more than it holds."""
    if not isinstance(snap, dict) or (snap.get("bundle_checksum"), snap.get("created")) != (
            checksum, created) or not 0 < snap.get("offset", -1) <= length:
        return None
    return int(snap["offset"])


def journal_path(directory: Path, checksum: str) -> Path:
    """Where the journal of the bundle with this checksum lives in an audit directory."""
    return Path(directory) / f"guard-{checksum[:16]}.jsonl"


class Journal:
    """One bundle's event journal (see the module docstring); one instance per process."""

    def __init__(self, path: Path, checksum: str, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.checksum = checksum
        self.fsync = fsync
        self.owner = uuid.uuid4().hex[:12]
        self._offset = 0  # bytes of the file this process has read (complete lines only)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        owners = self.path.parent / OWNERS
        owners.mkdir(exist_ok=True)
        self._owner_file = open(owners / f"{self.owner}.lock", "w")  # noqa: SIM115 - held for life
        fcntl.flock(self._owner_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        with self._locked(fcntl.LOCK_EX):
            self._repair()
            if os.fstat(self._fd).st_size == 0:
                self._write({"v": VERSION, "bundle_checksum": checksum, "created": time.time()})
        header = self._lines(limit=1)
        if not header or header[0].get("bundle_checksum") != checksum:
            raise ValueError(f"{self.path} is the audit journal of another bundle "
                             f"({(header or [{}])[0].get('bundle_checksum')!r}); move it away")
        self.created = header[0].get("created")  # tells this journal from a recreated one
        self._offset = 0

    @contextmanager
    def _locked(self, how: int) -> Iterator[None]:
        fcntl.flock(self._fd, how)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _repair(self) -> None:
        """Cut a torn last line (a process died in the middle of writing it); under LOCK_EX."""
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        tail = os.pread(self._fd, min(size, 1 << 20), max(0, size - (1 << 20)))
        if tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n")
        keep = (size - len(tail) + cut + 1) if cut >= 0 else 0
        os.ftruncate(self._fd, keep)

    def _write(self, event: dict[str, Any], durable: bool = True) -> None:
        os.write(self._fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())
        if self.fsync and durable:
            os.fsync(self._fd)

    def _lines(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Complete lines after this process's offset (advancing it)."""
        size = os.fstat(self._fd).st_size
        data = os.pread(self._fd, size - self._offset, self._offset)
        end = data.rfind(b"\n") + 1
        out = []
        pos = 0
        while pos < end and (limit is None or len(out) < limit):
            nl = data.index(b"\n", pos)
            out.append(json.loads(data[pos:nl]))
            pos = nl + 1
        self._offset += pos
        return out

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

    def write_snapshot(self, state: dict[str, Any]) -> None:
        """Save the state folded from the journal up to `offset` (atomically, see above)."""
        tmp = self.path.parent / f".{self.path.stem}.{self.owner}.tmp"
        with open(tmp, "w") as f:
            json.dump({"v": VERSION, "bundle_checksum": self.checksum, "created": self.created,
                       "offset": self._offset, "state": state}, f, separators=(",", ":"))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, self.snapshot_path)

    def read_snapshot(self) -> dict[str, Any] | None:
        """The latest snapshot's state, positioned at its offset; None when there is none,
        it is unreadable, or it is not this journal's (the caller then replays it all)."""
        try:
            snap = json.loads(self.snapshot_path.read_text())
        except (OSError, ValueError):
            return None
        offset = snapshot_offset(snap, self.checksum, self.created, os.fstat(self._fd).st_size)
        if offset is None:
            return None
        self._offset = offset
        return snap["state"]

    def rewind(self) -> None:
        """Read the journal from its start again (a snapshot that could not be used)."""
        self._offset = 0

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
