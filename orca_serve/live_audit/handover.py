"""Hot reload: a new bundle's live audit takes over from the old one.

The table, the guards, the recalibration window and the drift monitor are the new bundle's,
because every one of them is about one probe and its thresholds (with an audit directory:
resumed from that bundle's journal). Audits of requests the old bundle served (waiting for
labels, being labelled, or still running) are dropped and counted as `superseded` in the new
table: their losses measure the old thresholds, and the old table is gone. The metrics read
whichever audit serves (`orca_serve.live_audit.collector`), so nothing moves to the successor
but the store and the engine client's getter.

The new bundle's journal may be folded by other processes already (the servers sharing the
directory, a fleet's replicas): the successor joins them only under the same flags
(journal.py `joined`). A reload checks that before anything changes (`check_takeover`) and is
refused otherwise; should such a process join in the seconds between the check and the swap,
the successor audits without journal or directory (logged with the same line) rather than
fold their events into other decisions.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from orca_method.bundle import Bundle
from orca_method.errors import first_line
from orca_serve.live_audit.factory import make_live_audit
from orca_serve.live_audit.journal import FoldSettingsDiffer
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import (
    FOLD_FORMAT,
    AuditConfig,
    audit_journal,
    fold_flags,
    store_info,
)

logger = logging.getLogger("orca_serve.live_audit")


def hand_over(old: LiveAudit, bundle: Bundle, config: AuditConfig) -> LiveAudit:
    """The audit of `bundle` (as `config` sets it up) that takes over from `old` (the module
    docstring): `old` retires (its unfinished audits are counted as `superseded` by the
    successor, its journal is closed first, since the successor may open the same file), and
    the successor writes to the old audit's store when the two bundles' audit records agree
    (same model and pooling), else opens its own. A directory or journal that cannot be opened
    or joined (the module docstring) is logged, and the successor audits without them."""
    superseded, store = old.retire()
    if store is not None and (config.directory is None
                              or store.info != store_info(bundle, config.probe)):
        store.close()
        store = None
    try:
        return make_live_audit(bundle, config, old.engine_client, store=store,
                               superseded=superseded)
    except (OSError, FoldSettingsDiffer) as e:
        logger.warning("orca: the new live audit cannot open its directory or journal (%s): its "
                       "audits are neither stored nor journalled", first_line(e))
        return make_live_audit(bundle, replace(config, directory=None, store=None),
                               old.engine_client, superseded=superseded)


def check_takeover(bundle: Bundle, config: AuditConfig) -> None:
    """Raise FoldSettingsDiffer when the processes folding `bundle`'s journal run with other
    flags than `config`'s: a reload's check before anything changes (the module docstring). It
    joins and leaves at once; a journal that cannot be opened is left to `hand_over`."""
    if not config.journalled:
        return
    try:
        journal = audit_journal(config, bundle)
    except OSError:
        return
    try:
        journal.join(fold_flags(config), FOLD_FORMAT)
    finally:
        journal.close()
