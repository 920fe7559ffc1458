"""Hot reload: a new bundle's live audit takes over from the old one.

The table, the guards, the recalibration window and the drift monitor are the new bundle's,
because every one of them is about one probe and its thresholds (with an audit directory:
resumed from that bundle's journal). Audits of requests the old bundle served (waiting for
labels, being labelled, or still running) are dropped and counted as `superseded` in the new
table: their losses measure the old thresholds, and the old table is gone.
"""

from __future__ import annotations

from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import audit_journal, audit_store, store_info


def hand_over(old: LiveAudit, successor: LiveAudit) -> None:
    """A new bundle's audit takes over from `old` (the module docstring): the old one's
    unfinished audits are dropped and counted as `superseded` there, its metrics collector
    reads the successor from now on, and the successor writes to the old audit's store when
    the two bundles' audit records agree (same model and pooling), else opens its own."""

    successor.counts["superseded"] += old.retire()
    if old.collector is not None:
        old.collector.audit = successor
        successor.collector, old.collector = old.collector, None
    if successor.config.directory is not None and successor.store is None:
        new_info = store_info(successor.bundle, successor.config.probe)
        if old.store is not None and old.store.info == new_info:
            successor.store = old.store
        else:
            if old.store is not None:
                old.store.close()
            successor.store = audit_store(successor.config, successor.bundle)
    old.store = None
    if old.journal is not None:  # closed first: the successor may open the same file
        old.journal.close()
        old.journal = None
    if successor.config.journalled and successor.journal is None:
        successor.attach(audit_journal(successor.config, successor.bundle))
    successor.engine_client = old.engine_client
