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
    """The live audit of `bundle` as `config` sets it up: its journal, joined and replayed
    (orca_serve/live_audit/journal.py), then its store (`store`: one taken over by a hot
    reload; else opened when a directory is set). `engine_client`: returns the server's engine
    client, which labels the audits. Raises OSError when the directory or journal cannot be
    opened, FoldSettingsDiffer when the processes folding the journal run with other flags
    (journal.py `joined`); the store, given or opened, and the journal are closed then.

    The store is opened after the journal is joined: opened first, a start refused for its
    guard flags left an empty `audit-NNNNNN` behind (a new one whenever a running server held
    the newest, and that rotation could delete the oldest past `--orca-audit-keep`)."""
    try:
        journal = audit_journal(config, bundle) if config.journalled else None
        audit = LiveAudit(bundle, config, journal=journal, store=store,
                          drift=DriftMonitor.from_bundle(bundle),
                          sequential=ConformalMartingale.from_bundle(bundle),
                          engine_client=engine_client,
                          superseded=superseded)
    except BaseException:
        if store is not None:
            store.close()
        raise
    if store is None and config.directory is not None:
        try:
            audit.store = audit_store(config, bundle)
        except BaseException:
            audit.close()
            raise
    return audit
