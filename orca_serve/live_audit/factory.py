"""The server's live audit, built with everything it works with: its journal and store when an
audit directory (or the fleet's store) is set, its drift tests, its link to the engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orca_method.audit.drift import DriftMonitor
from orca_method.audit.martingale import ConformalMartingale
from orca_method.bundle import Bundle
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig, audit_journal, audit_store
from orca_serve.live_audit.store import AuditStore


def make_live_audit(bundle: Bundle, config: AuditConfig,
                    engine_client: Callable[[], Any] | None = None, *,
                    store: AuditStore | None = None, superseded: int = 0) -> LiveAudit:
    """The live audit of `bundle` as `config` sets it up: its store (`store`: one taken over by
    a hot reload; else opened when a directory is set), then its journal, replayed
    (orca_serve/live_audit/journal.py). `engine_client`: returns the server's engine client,
    which labels the audits. Raises OSError when the directory or journal cannot be opened,
    FoldSettingsDiffer when the processes folding the journal run with other flags
    (orca_serve/live_audit/journal.py `joined`); the store, given or opened, is closed then."""
    if store is None and config.directory is not None:
        store = audit_store(config, bundle)
    try:
        journal = audit_journal(config, bundle) if config.journalled else None
        return LiveAudit(bundle, config, journal=journal, store=store,
                         drift=DriftMonitor.from_bundle(bundle),
                         sequential=ConformalMartingale.from_bundle(bundle),
                         engine_client=engine_client,
                         superseded=superseded)
    except BaseException:
        if store is not None:
            store.close()
        raise
