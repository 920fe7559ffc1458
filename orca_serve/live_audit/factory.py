"""The server's live audit, built with everything it works with: its journal and store when an
audit directory (or the fleet's store) is set, its drift tests, its link to the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from orca_method.audit.drift import DriftMonitor
from orca_method.audit.martingale import ConformalMartingale
from orca_method.bundle import Bundle
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig, audit_journal, audit_store


def make_live_audit(bundle: Bundle, config: AuditConfig,
                    engine_client: Callable[[], Any] | None = None, *,
                    stored: bool = True, ours: Iterable[str] = ()) -> LiveAudit:
    """The live audit of `bundle` as `config` sets it up: its journal, joined and replayed
    (orca_serve/live_audit/journal.py), then its store, opened when a directory is set
    (`stored`; False: a hot reload's successor, which may take the old audit's over,
    orca_serve/live_audit/handover.py). `engine_client`: returns the server's engine client,
    which labels the audits; `ours`: the owners of this process's other journals (journal.py
    `Journal`). Raises OSError when the directory or journal cannot be opened, JournalRefused
    when the processes folding the journal run with other flags (journal.py `joined`) or a
    store key of the journal holds another type (redis_journal.py `KeyOfAnotherType`); the
    journal is closed then.

    The store is opened after the journal is joined: opened first, a start refused for its
    guard flags left an empty `audit-NNNNNN` behind (a new one whenever a running server held
    the newest, and that rotation could delete the oldest past `--orca-audit-keep`)."""
    journal = audit_journal(config, bundle, ours) if config.journalled else None
    audit = LiveAudit(bundle, config, journal=journal,
                      drift=DriftMonitor.from_bundle(bundle),
                      sequential=ConformalMartingale.from_bundle(bundle),
                      engine_client=engine_client)
    if stored and config.directory is not None:
        try:
            audit.store = audit_store(config, bundle)
        except BaseException:
            audit.close()
            raise
    return audit
