"""Hot reload: a new bundle's live audit takes over from the old one.

The table, the guards, the recalibration window and the drift monitor are the new bundle's,
because every one of them is about one probe and its thresholds (with an audit directory:
resumed from that bundle's journal). Audits of requests the old bundle served (waiting for
labels, being labelled, or still running) are dropped and counted as `superseded` in the new
table: their losses measure the old thresholds, and the old table is gone. The metrics read
whichever audit serves (`orca_serve.live_audit.collector`), so nothing moves to the successor
but the store and the engine client's getter.

The new bundle's journal may be folded by other processes already (the servers sharing the
directory, a fleet's replicas): the successor joins them only under the same flags and fold
format (journal.py `joined`). So a reload builds the successor before anything changes
(`successor`: its journal opened, joined and replayed, once) and is refused when it cannot
join; joined, this process counts among the journal's running processes from then on, so none
with other flags can join before the swap (`take_over`). Before, the reload joined and left
the journal to check it, then opened it again at the swap: a store that was down was said
twice, and a process with other flags could join in between.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from orca_method.bundle import Bundle
from orca_method.errors import first_line
from orca_serve.live_audit.factory import make_live_audit
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig, audit_store, store_info

logger = logging.getLogger("orca_serve.live_audit")


def successor(old: LiveAudit, bundle: Bundle, config: AuditConfig) -> LiveAudit:
    """The audit of `bundle` (as `config` sets it up) that is to take over from `old`, built
    while `old` serves (a reload's check, in a thread: a journal's replay takes a millisecond
    per event and delta): its journal joined (`JournalRefused` when the processes folding it
    run with other flags or another fold format, or a store key of it holds another type: the
    reload is refused) and replayed, and
    no store yet (`take_over`). A directory or journal that cannot be opened is logged, and the
    successor audits without them. The caller closes it if the reload does not go through.
    `old`'s journal, open until the swap, is this process's own, not another one that may fold
    the new journal (a fold record that cannot be read is written anew when none runs)."""
    ours = () if old.state.journal is None else (old.state.journal.owner,)
    try:
        return make_live_audit(bundle, config, old.engine_client, stored=False, ours=ours)
    except OSError as e:
        logger.warning("orca: the new live audit cannot open its directory or journal (%s): its "
                       "audits are neither stored nor journalled", first_line(e))
        return make_live_audit(bundle, replace(config, directory=None, store=None),
                               old.engine_client)


def take_over(old: LiveAudit, new: LiveAudit) -> LiveAudit:
    """`new` (`successor`) takes over from `old` (the module docstring), at the swap: `old`
    retires (its unfinished audits are counted as `superseded` by `new`; its journal is
    closed), and `new` writes to the old audit's store when the two bundles' audit records
    agree (same model and pooling), else opens its own; one that cannot be opened is logged,
    and `new`'s audits are not stored."""
    superseded, store = old.retire()
    config = new.config
    if store is not None and (config.directory is None
                              or store.info != store_info(new.bundle, config.probe)):
        store.close()
        store = None
    if store is None and config.directory is not None:
        try:
            store = audit_store(config, new.bundle)
        except OSError as e:
            logger.warning("orca: the new live audit cannot open its directory (%s): its "
                           "audits are not stored", first_line(e))
    new.adopt(superseded, store)
    return new
