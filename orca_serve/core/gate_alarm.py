"""The gate alarm in the engine core (`orca_method.gate_alarm`; docs/SERVER.md, "The gate alarm").

One alarm per deployment (a bundle in one engine core: `Deployment.alarm`), on its gate: with data
parallelism each engine core tests its own share of the traffic, each at the stated level. It
hears a request's gate decision at the request's gate step (a few scored steps in, read back on
the next engine step), not when the request ends, so it lags by about two engine steps of
arrivals instead of by every request in flight.

- A request takes its place in the arrival order when it is added to the core (`take_ticket`):
  one per prompt (a child of n > 1 other than the first, or a vote's sample other than the first,
  `orca_alarm` 0, takes none: samples of one prompt are not independent draws).
- Its gate's p-value feeds the alarm when the host reads it back (`feed`, from
  `plan.apply_readback`); a request that leaves before its gate decided gives its place up
  (`feed` with None, from `table.RequestTable.leave`). `orca_method.gate_alarm.ArrivalFeed`
  keeps the order (a request not decided yet holds back the ones after it).
- While the alarm is raised every gated request that acts (not an audited shadow one) is served
  as a flagged one from its next scored step on (`serves`, from `plan`): held before its gate
  step as every request is, then the deployment's safe lambda (never below its own) and no
  give-up. A request already past its gate unflagged switches too: its stop then comes no
  earlier than under the safe lambda alone (it had not stopped under its own, smaller one), so
  its stop loss is at most what the flagged policy's would be, and it never gives up. Once
  served so it stays so (`Request.shift_alarm`), also after the alarm clears.

Everything here runs on the host from values already read back: no device sync.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from orca_method.gate_alarm import AlarmChange, GateAlarm

if TYPE_CHECKING:
    from orca_serve.core.registry import Request

log = logging.getLogger("orca_serve.core")


def take_ticket(req: Request) -> None:
    """A request added to the core takes its place in its deployment's arrival order (module
    docstring: gated, the first of its prompt)."""
    feed = req.dep.alarm
    if feed is not None and req.gated and req.index == 0 and req.settings.alarm:
        req.alarm_ticket = feed.ticket()


def feed(req: Request, pvalue: float | None, stats: dict[str, Any]) -> None:
    """The request's gate p-value to its deployment's alarm (None: it left before its gate
    decided); counts and logs what that changed. Once per request: later calls do nothing."""
    ticket, req.alarm_ticket = req.alarm_ticket, None
    if ticket is None:
        return
    arrivals = req.dep.alarm
    assert arrivals is not None  # a ticket comes from the deployment's feed
    for change in arrivals.decided(ticket, pvalue):
        stats["alarm_raised" if change.raised else "alarm_cleared"] += 1
        _log(arrivals.alarm, change)


def serves(req: Request) -> bool:
    """Whether the request runs as a flagged one because of the alarm (module docstring), marking
    it so when the alarm is raised now: gated, acting (an audited shadow request runs to its
    end anyway), not flagged by its own gate already."""
    if req.shift_alarm:
        return True
    arrivals = req.dep.alarm
    if (arrivals is None or not arrivals.alarmed or not req.gated or req.shift_flagged
            or not req.policy.rule.acts):
        return False
    req.shift_alarm = True
    return True


def _log(a: GateAlarm, change: AlarmChange) -> None:
    if change.raised:
        log.warning("orca: gate alarm raised after %d gated requests (%d flagged; the flag rate "
                    "is above %.3f, what traffic like the calibration set allows at level %g): "
                    "every request is now served as a flagged one", a.seen, a.flags, a.bound,
                    a.level)
    else:
        log.warning("orca: gate alarm cleared after %d gated requests (the flag rate is below "
                    "%.3f again): requests are served as the gate decides",
                    a.seen - (a.since or 0), a.clear_rate)
