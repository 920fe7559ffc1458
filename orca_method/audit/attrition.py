"""Which audited requests did not finish, so that their loss is unknown (censored).

An audit measures the loss of a request that ran to its natural end: the answer after the last
step is what the consistency labels compare every step with. A request cut by `max_tokens`
(finish_reason `length`) or never finished (the client went away, the server aborted it: no
finish_reason, or vLLM's `abort`) has no such end, so its loss is unknown. Leaving such audits
out biases the risk low when being cut depends on the loss (long, hard requests are cut more
often, and are where an early stop is wrong), so they enter the statistics censored, by the
server and by the offline tools alike (`CensoredAlarm`: loss 0 for the alarm, loss 1 for the
upper bound; docs/AUDIT.md, "Cut and aborted audits"), and the table shows their share.
"""

from __future__ import annotations

# finish_reason -> the count it goes to; None: the response never reported one
INCOMPLETE: dict[str | None, str] = {"length": "length", "abort": "aborted", None: "aborted"}


def incomplete(finish_reason: str | None) -> str | None:
    """The count an audit with this finish_reason goes to when it is censored, else None."""
    return INCOMPLETE.get(finish_reason)
