"""One audit for a fleet: the journal on a shared store, and this replica's own guard without it.

With `--orca-audit-store redis://host:port/db` every replica (every orca-serve process) of a
deployment journals its audits to one Redis list per bundle (orca_serve/live_audit/redis_journal.py),
so all of them fold one sequence per bundle and delta and act on one decision (docs/AUDIT.md,
"A fleet"), under one set of guard flags: a replica with others is refused when it joins
(journal.py `joined`).

A replica that cannot reach the store (or whose call it answers with an error) keeps serving
with its **own local guard**, says so once in the log (a warning) and in /metrics
(`orca_audit_store_up` 0; the table's `store`):
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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import redis
from prometheus_client.core import GaugeMetricFamily

from orca_serve.live_audit.journal import (
    Journal,
    JournalLost,
    LocalFallback,
    MemoryJournal,
    journal_path,
)
from orca_serve.live_audit.redis_journal import RedisJournal, StoreRolledBack, shown_url
from orca_serve.metrics.prometheus import LABEL

logger = logging.getLogger("orca_serve.live_audit")


class FleetJournal(LocalFallback):
    """The store's journal while it answers; the local guard's from the first failure on."""

    lost_on = (redis.RedisError, JournalLost)

    def __init__(self, url: str, checksum: str, directory: Path | None,
                 ours: Iterable[str] = ()) -> None:
        """`ours`: the owners of this process's other journals (journal.py `Journal`)."""
        self.url = shown_url(url)
        try:
            super().__init__(RedisJournal(url, checksum, ours=ours))
        except redis.RedisError as e:
            super().__init__(Journal(journal_path(directory, checksum), checksum, ours=ours)
                             if directory is not None else MemoryJournal("local"))
            self.lost(e, "at start", self.url)

    @property
    def up(self) -> bool:
        return isinstance(self.journal, RedisJournal)

    def lost(self, e: Exception, when: str, left: Any) -> None:
        """The store left (said as such), or then the local file journal too."""
        if self.down_since is not None:  # the store was left before: its local file failed
            super().lost(e, when, left)
            return
        self.down_since = time.time()
        # said apart from an unreachable store, so that an operator looks where the fault is: a
        # rollback at the store's persistence (an older save, a restart without it, a flush), an
        # error answered at that error (WRONGTYPE: a key that changed type; OOM: a full store)
        what = ("lost events this replica had applied (restored from an older save, restarted "
                "without persistence, or flushed)" if isinstance(e, StoreRolledBack)
                else "answered a call with an error" if isinstance(e, redis.ResponseError)
                else "is unreachable")
        logger.warning("orca audit: the audit store %s %s %s (%s); this replica goes on with "
                       "its own local guard (%s) until it restarts", self.url, what, when, e,
                       self.path)

    def state(self) -> dict[str, Any]:
        """The table's `store`."""
        return {"url": self.url, "up": self.up, "down_since": self.down_since}


def store_state(journal: Any) -> dict[str, Any] | None:
    """The table's `store`: None unless the audit journals to a shared store."""
    return journal.state() if isinstance(journal, FleetJournal) else None


def store_metrics(journal: Any, model_name: str) -> list[GaugeMetricFamily]:
    """`orca_audit_store_up` for an audit on a shared store, `orca_audit_journal_up` for one on
    a file journal (none otherwise)."""
    if isinstance(journal, LocalFallback) and not isinstance(journal, FleetJournal):
        g = GaugeMetricFamily("orca_audit_journal_up", "1 while the audit journals to its file in "
                              "--orca-audit-dir; 0 once this process went on with its own guard "
                              "in memory (the file was cut shorter or could not take a line; it "
                              "attaches anew when restarted)", labels=[LABEL])
        g.add_metric([model_name], float(journal.down_since is None))
        return [g]
    if not isinstance(journal, FleetJournal):
        return []
    g = GaugeMetricFamily("orca_audit_store_up", "1 while the audit journals to the fleet's "
                          "shared store; 0 once this replica went on with its own local guard "
                          "(the store was unreachable; it rejoins when restarted)",
                          labels=[LABEL, "store"])
    g.add_metric([model_name, journal.url], float(journal.up))
    return [g]
