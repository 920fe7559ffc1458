"""One audit for a fleet: the journal on a shared store, and this replica's own guard without it.

With `--orca-audit-store redis://host:port/db` every replica (every orca-serve process) of a
deployment journals its audits to one Redis list per bundle (orca_serve/live_audit/redis_journal.py),
so all of them fold one sequence per bundle and delta and act on one decision (docs/AUDIT.md,
"A fleet").

A replica that cannot reach the store keeps serving with its **own local guard**, says so once in
the log (a warning) and in /metrics (`orca_audit_store_up` 0; the table's `store`):
- unreachable when the replica starts: the file journal in its `--orca-audit-dir` when it has
  one (so its restarts during an outage resume its own guard), else a guard in memory;
- lost while serving: the guard goes on in memory from the state it had folded from the store.
It does not rejoin the store before it restarts: the audits its local guard took cannot be put
into the shared order after the fact without changing what the others already decided on
(their admission numbers, a recalibration window), and adopting the store's state would undo a
decision the local guard took (a fallback it engaged). A restart rejoins (it resumes the
store's state), so an operator who sees the metric at 0 restarts that replica once the store
is back. While it is out, the fleet's statement holds for the shared sequence, and the local
guard is a separate test with its own epsilon.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import redis
from prometheus_client.core import GaugeMetricFamily

from orca_serve.live_audit.journal import EventJournal, Journal, journal_path
from orca_serve.live_audit.redis_journal import RedisJournal, shown_url
from orca_serve.metrics.prometheus import LABEL

logger = logging.getLogger("orca_serve.live_audit")


class MemoryJournal:
    """This process's own events, in memory: the local guard when no store and no directory
    hold them. Alone, so nothing precedes its appends, and only its own owner is alive (another
    replica's audit that was open in the store never resolves here: it is reaped as lost)."""

    path = "memory (this process only)"
    skipped = 0  # nothing is read back, so nothing is ever corrupt

    def __init__(self, owner: str) -> None:
        self.owner = owner

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


class FleetJournal:
    """The store's journal while it answers; the local guard's from the first failure on."""

    def __init__(self, url: str, checksum: str, directory: Path | None) -> None:
        self.url = shown_url(url)
        self.down_since: float | None = None
        self.local: EventJournal | None = None
        self.remote: RedisJournal | None = None
        try:
            self.remote = RedisJournal(url, checksum)
        except redis.RedisError as e:
            self.local = (Journal(journal_path(directory, checksum), checksum)
                          if directory is not None else MemoryJournal("local"))
            self._down(e, "at start")

    @property
    def up(self) -> bool:
        return self.remote is not None

    @property
    def owner(self) -> str:
        return self._active().owner

    @property
    def path(self) -> Any:
        return self._active().path

    @property
    def skipped(self) -> int:
        return self._active().skipped

    def _active(self) -> EventJournal:
        return self.remote if self.remote is not None else self.local  # type: ignore[return-value]

    def _down(self, e: Exception, when: str) -> None:
        self.down_since = time.time()
        logger.warning("orca audit: the audit store %s is unreachable %s (%s); this replica "
                       "goes on with its own local guard (%s) until it restarts", self.url,
                       when, e, self.path)

    def _lose(self, e: Exception) -> None:
        """Leave the store for good (module docstring): the guard goes on in memory from the
        state folded so far, under the same owner."""
        assert self.remote is not None
        remote, self.remote = self.remote, None
        self.local = MemoryJournal(remote.owner)
        remote.close()
        self._down(e, "while serving")

    def _try(self, call: str, *args: Any) -> Any:
        if self.remote is not None:
            try:
                return getattr(self.remote, call)(*args)
            except redis.RedisError as e:
                self._lose(e)
        return getattr(self.local, call)(*args)

    def read(self) -> list[dict[str, Any]]:
        return self._try("read")

    def append(self, event: dict[str, Any], durable: bool = True) -> list[dict[str, Any]]:
        return self._try("append", event, durable)

    def read_snapshot(self) -> dict[str, Any] | None:
        return self._try("read_snapshot")

    def write_snapshot(self, state: dict[str, Any]) -> None:
        self._try("write_snapshot", state)

    def rewind(self) -> None:
        self._active().rewind()

    def alive(self, owner: str) -> bool:
        return self._try("alive", owner)

    def close(self) -> None:
        self._active().close()

    def state(self) -> dict[str, Any]:
        """The table's `store`."""
        return {"url": self.url, "up": self.up, "down_since": self.down_since}


def store_state(journal: Any) -> dict[str, Any] | None:
    """The table's `store`: None unless the audit journals to a shared store."""
    return journal.state() if isinstance(journal, FleetJournal) else None


def store_metrics(journal: Any, model_name: str) -> list[GaugeMetricFamily]:
    """`orca_audit_store_up` for an audit on a shared store (none otherwise)."""
    if not isinstance(journal, FleetJournal):
        return []
    g = GaugeMetricFamily("orca_audit_store_up", "1 while the audit journals to the fleet's "
                          "shared store; 0 once this replica went on with its own local guard "
                          "(the store was unreachable; it rejoins when restarted)",
                          labels=[LABEL, "store"])
    g.add_metric([model_name, journal.url], float(journal.up))
    return [g]
