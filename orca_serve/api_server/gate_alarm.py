"""The server's side of the gate alarm (`orca_method.gate_alarm`; docs/SERVER.md, "The gate
alarm"): one per API server process and bundle, in its `Serving`.

The middleware takes a ticket when it resolves a request the gate may run for and hands the
request's gate p-value back when it finishes (None: the gate did not decide for it). The alarm
is fed in **arrival order**, not finishing order: a flagged request reasons in full and finishes
later than an unflagged one, so the order requests finish in depends on their flags, and the
alarm's bets (each made on the past flags only) would lose their guarantee. A request that has
not finished holds back the ones after it.

Each API server process keeps its own alarm, on the requests it resolved (with `--api-server-count`
> 1 each process tests its share of the traffic, each at the stated level).
"""

from __future__ import annotations

import logging

from orca_method.bundle import Bundle
from orca_method.gate_alarm import GateAlarm
from orca_serve.metrics.prometheus import AlarmChange, OrcaMetrics
from orca_serve.settings.contract import ShiftAction
from orca_serve.settings.resolve import OrcaDefaults

logger = logging.getLogger("orca_serve.api_server.server")


class AlarmFeed:
    """A `GateAlarm` fed in arrival order (module docstring); logs and metrics on each change."""

    def __init__(self, alarm: GateAlarm, metrics: OrcaMetrics | None = None) -> None:
        self.alarm = alarm
        self.metrics = metrics
        self._issued = 0  # tickets handed out
        self._fed = 0  # the next ticket the alarm waits for
        self._done: dict[int, float | None] = {}  # finished, waiting for an earlier ticket
        if metrics is not None:
            metrics.alarm_state(alarm.alarmed)

    @property
    def alarmed(self) -> bool:
        return self.alarm.alarmed

    @property
    def waiting(self) -> int:
        """Requests resolved with a ticket whose p-value the alarm has not read yet."""
        return self._issued - self._fed

    def ticket(self) -> int:
        """A new request's place in the arrival order."""
        self._issued += 1
        return self._issued - 1

    def finished(self, ticket: int, pvalue: float | None) -> None:
        """Request `ticket` finished with its gate p-value (None: no decision, skipped): feed it
        and every later one already finished, in order."""
        self._done[ticket] = pvalue
        while self._fed in self._done:
            p = self._done.pop(self._fed)
            self._fed += 1
            if p is None:
                continue
            change = self.alarm.observe(p)
            if change.raised or change.cleared:
                self._changed(AlarmChange.RAISED if change.raised else AlarmChange.CLEARED)

    def _changed(self, change: AlarmChange) -> None:
        a = self.alarm
        if change == AlarmChange.RAISED:
            logger.warning("orca: gate alarm raised after %d gated requests (%d flagged; the flag "
                           "rate is above %.3f, what traffic like the calibration set allows at "
                           "level %g): every request is now served as a flagged one", a.seen,
                           a.flags, a.bound, a.level)
        else:
            logger.warning("orca: gate alarm cleared after %d gated requests (the flag rate is "
                           "below %.3f again): requests are served as the gate decides",
                           a.seen - (a.since or 0), a.clear_rate)
        if self.metrics is not None:
            self.metrics.alarm_state(a.alarmed, change)


def alarm_feed(bundle: Bundle | None, defaults: OrcaDefaults,
               metrics: OrcaMetrics | None = None) -> AlarmFeed | None:
    """The alarm on `bundle`'s gate at the server's level (`defaults.shift_alpha`, else the
    bundle's alpha); None without a gate, with the gate off (`--orca-shift-action off`, alpha 0)
    or the alarm off (`--orca-gate-alarm 0`)."""
    gate = None if bundle is None else bundle.shift_gate
    if gate is None or defaults.shift_action == ShiftAction.OFF or defaults.gate_alarm <= 0:
        return None
    alpha = gate.alpha if defaults.shift_alpha is None else defaults.shift_alpha
    if alpha <= 0:
        return None
    return AlarmFeed(GateAlarm(len(gate.scores), alpha, defaults.gate_alarm), metrics)
