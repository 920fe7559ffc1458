"""The server log's lines about the guards: an alarm raised or cleared, the threshold served.

One line per change, so an operator reading the log sees when a delta fell back, was
recalibrated or came back, and when give-up was turned off or on again.
"""

from __future__ import annotations

import logging
import math

from orca_method.audit.guards import DeltaGuard, GiveUpGuard
from orca_method.outcomes import Source

logger = logging.getLogger("orca_serve.live_audit")


def shown_lam(lam: float) -> str:
    return "never (no early stop)" if math.isinf(lam) else f"{lam:g}"


def shown_mu(mu: float) -> str:
    return "never (no give-up)" if math.isinf(mu) else f"{mu:g}"


def log_change(g: DeltaGuard, was_engaged: bool, was_source: Source, was_lam: float) -> None:
    """One server-log line per change of a guard: alarm raised or cleared, and the lambda served
    (fallback, recalibrated, the bundle's again)."""
    n, d = int(g.cs.n), f"{g.delta:g}"
    if g.engaged and not was_engaged and not (n and g.cs.alarm(g.delta)):
        logger.warning("orca audit: delta %s engaged by the sequential drift test after %d "
                       "audits (on alarm: %s)", d, n, g.on_alarm)
    elif g.engaged and not was_engaged:
        logger.warning("orca audit: ALARM at delta %s after %d audits: the realized risk of the "
                       "bundle's lambda* %s has lower bound %.3f > delta (on alarm: %s)", d, n,
                       shown_lam(g.bundle_lam), g.cs.alarm_source(g.delta)[1] or g.cs.lower,
                       g.on_alarm)
    elif was_engaged and not g.engaged:
        logger.info("orca audit: alarm at delta %s cleared after %d audits (upper bound %.3f <= "
                    "delta)", d, n, g.cs.upper)
    if (g.source, g.lam) != (was_source, was_lam):
        how = {Source.FALLBACK: "fallback",
               Source.AUDIT: "recalibrated on the audits after the alarm",
               Source.BUNDLE: "the bundle's lambda*"}[g.source]
        logger.warning("orca audit: delta %s now served with lambda %s (%s; was %s)", d,
                       shown_lam(g.lam), how, shown_lam(was_lam))


def log_give_up_change(g: GiveUpGuard, was_engaged: bool, was_source: Source) -> None:
    """One server-log line per change of a give-up guard: alarm raised or cleared, give-up
    turned off, on with a recalibrated mu, or on again."""
    n, d = int(g.cs.n), f"{g.delta:g}"
    if g.engaged and not was_engaged:
        logger.warning("orca audit: give-up ALARM at give-up delta %s after %d audits: the "
                       "audited give-up risk of the bundle's mu* %s has lower bound %.3f > "
                       "delta (on alarm: %s)", d, n, shown_mu(g.bundle_mu),
                       g.cs.alarm_source(g.delta)[1] or g.cs.lower, g.on_alarm)
    elif was_engaged and not g.engaged:
        logger.info("orca audit: give-up alarm at give-up delta %s cleared after %d audits "
                    "(upper bound %.3f <= delta)", d, n, g.cs.upper)
    if g.source != was_source:
        how = {Source.FALLBACK: "off (requests reason on; the stop thresholds are unchanged)",
               Source.AUDIT: f"on with mu {shown_mu(g.mu)}, recalibrated on the audits after "
                             "the alarm (consistency labels)",
               Source.BUNDLE: f"on again (mu* {shown_mu(g.mu)})"}[g.source]
        logger.warning("orca audit: give-up delta %s now %s", d, how)
