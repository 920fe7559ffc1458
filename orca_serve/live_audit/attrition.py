"""Which audited requests are left out of the realized risk because they did not finish.

An audit measures the loss of a request that ran to its natural end: the answer after the last
step is what the consistency labels compare every step with. A request cut by `max_tokens`
(finish_reason `length`) or never finished (the client went away, the server aborted it: no
finish_reason, or vLLM's `abort`) has no such end; labelling it as if its last step were final
would make its loss 0 at every lambda. Such audits are counted and left out, by the server and
by the offline tools alike. Leaving them out biases the risk when being cut depends on the
risk (long, hard requests are cut more often), so the table shows their share next to the
other losses of audits (dropped, failed, unaligned): the larger it is, the less the measured
risk speaks for all traffic.
"""

from __future__ import annotations

# finish_reason -> the count it goes to; None: the response never reported one
INCOMPLETE: dict[str | None, str] = {"length": "length", "abort": "aborted", None: "aborted"}


def incomplete(finish_reason: str | None) -> str | None:
    """The count an audit with this finish_reason goes to when it is left out, else None."""
    return INCOMPLETE.get(finish_reason)
