"""Which audited requests did not finish, so that their loss is unknown (censored).

An audit measures the loss of a request that ran to its natural end: the answer after the last
step is what the consistency labels compare every step with. A request cut by `max_tokens`
(finish_reason `length`) or never finished (the client went away, the server aborted it: no
finish_reason, or vLLM's `abort`) has no such end, so its loss is unknown at every threshold that
would stop after where it ended (at one that stops before, the label at the stop gives it:
`orca_method.audit.guards.cut_feed`). Leaving such audits out biases the risk low when being
cut depends on the loss (long, hard requests are cut more often, and are where an early stop is
wrong), so at those thresholds they enter the statistics censored, by the server and by the
offline tools alike (`CensoredAlarm`: loss 0 for the alarm; for the upper bound loss 1, or for a
cut audit the loss at its cut, which the certified population counts), docs/AUDIT.md, "Cut and
aborted audits"; the table shows their share.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from orca_method.outcomes import FinishReason


class Cause(StrEnum):
    """Why a censored audit did not finish: its attrition count, and its outcome event's "c"
    (members equal the journal's words)."""

    CUT = "length"  # cut by max_tokens: its cut is its end (section 10)
    ABORTED = "aborted"  # never finished


# finish_reason -> the count it goes to; None: the response never reported one
INCOMPLETE: dict[str | None, Cause] = {FinishReason.LENGTH: Cause.CUT,
                                       FinishReason.ABORT: Cause.ABORTED, None: Cause.ABORTED}


def incomplete(finish_reason: str | None) -> Cause | None:
    """The count an audit with this finish_reason goes to when it is censored, else None."""
    return INCOMPLETE.get(finish_reason)


def recorded_incomplete(extra: Mapping[str, Any] | None) -> Cause | None:
    """`incomplete` of a trajectory record's `extra` (docs/TRAJECTORIES.md): what the offline
    tools apply to an audit record, by the server's own rule. A record with a `finish_reason`
    field is judged by it, null included: the server journals an audit whose response never
    finished (the client went away) with `finish_reason: null`, and counted it censored. A
    record without the field was not written by a server or `collect` (synthetic or imported
    trajectories: complete by construction), and counts as finished."""
    if extra is None or "finish_reason" not in extra:
        return None
    return incomplete(extra["finish_reason"])
