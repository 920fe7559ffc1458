"""The server's live audit, built from the `orca-serve` options: its journal and store when an
audit directory is set, its metrics registered."""

from __future__ import annotations

import argparse
from typing import Any

from orca_method.audit.drift import DriftMonitor
from orca_serve.live_audit.collector import AuditCollector
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import audit_config, audit_journal, audit_store


def make_live_audit(ns: argparse.Namespace, bundle: Any, registry: Any,
                    model_name: str = "", *, store: bool = True) -> Any:
    """The server's LiveAudit (metrics registered on `registry` with vLLM's `model_name`
    label), its store when a dir is set. `store=False`: without one (a hot reload opens it, or
    takes the old audit's, when it takes over: `orca_serve.live_audit.handover`)."""
    config = audit_config(ns, bundle)
    live = LiveAudit(bundle, config, drift=DriftMonitor.from_bundle(bundle))
    if store and config.directory is not None:
        live.store = audit_store(config, bundle)
    if store and config.journalled:
        live.attach(audit_journal(config, bundle))
    if registry is not None:
        live.collector = AuditCollector(live, model_name)
        registry.register(live.collector)
    return live
