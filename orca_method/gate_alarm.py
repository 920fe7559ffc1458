"""The gate alarm: a label-free, fleet-level sequential test on the shift gate's decisions.

The per-request gate (`orca_method.shift_gate`) flags a shifted request only with its power; on
a family it flags 86% of, the other 14% are served the in-distribution lambda*, which on that
family may be badly wrong. Those requests cannot be told apart one by one, but the *stream* can:
on traffic exchangeable with the calibration split the gate flags about alpha of requests, so a
flag rate clearly above that says the traffic moved. The alarm tests exactly that, without a
label, and while it is raised the engine serves every gated request as a flagged one
(orca_serve/core/gate_alarm.py).

**The null, honestly.** Test requests share one calibration set, so their flags are not
independent given it: with m = floor(alpha (n + 1)) (the flag count of `shift_gate.threshold`),
a request is flagged when its score exceeds the calibration split's (n + 1 - m)-th smallest, and
the flag rate given the calibration set is r = 1 - F(s_(n+1-m)), which is Beta(m, n + 1 - m)
distributed over calibration sets for continuous scores (and stochastically smaller with ties):
its mean is <= alpha, but a given deployment's r can exceed alpha. So the alarm tests
"r <= b" with b = the Beta(m, n + 1 - m) quantile at 1 - eps, which holds with probability
>= 1 - eps over the calibration set (a training-conditional guarantee, Vovk 2012, "Conditional
validity of inductive conformal predictors"). Given the calibration set, requests drawn i.i.d.
from the calibration distribution have i.i.d. Bernoulli(r) flags.

**The test.** A betting martingale (Shafer & Vovk; Waudby-Smith & Ramdas 2023, "Estimating means
of bounded random variables by betting"): a bet of fraction f on "flagged" multiplies the wealth
by 1 + (f / b)(x - b), whose expectation given the past is <= 1 when r <= b. The wealth is a
mixture over bets f in `BETS` (one bet never fits both a 0.86 and a 0.5 flag rate) and over the
request k at which betting starts, with weights w_k = 1 / (k (k + 1)) summing to 1, so that a
shift after a long in-distribution stretch is caught as fast as one at the start (a fixed bet's
wealth decays towards 0 in distribution; a late start costs only log(1 / w_k) ~ 2 log k of
evidence; a change-point mixture in the spirit of Shin, Ramdas & Rinaldo 2023, "E-detectors",
with summable weights so that it stays a test supermartingale). The alarm is raised when the
wealth reaches 1 / gamma; by Ville's inequality, given a calibration set with r <= b,
P(ever) <= gamma. **Combined: on traffic i.i.d. with the calibration split, P(the alarm is ever
raised) <= eps + gamma = `level`** (eps = gamma = level / 2).

**Clearing.** While raised, the alarm runs the mirror test of "the flag rate is >= c", with
c = `CLEAR_FACTOR` x b (capped below 1), the same mixture, the same gamma, from the request after
the alarm. It clears when that wealth reaches 1 / gamma: while the traffic's flag rate stays
>= c, P(the alarm clears) <= gamma. After a clear the detection test starts afresh (its weights
from k = 1): each stretch from a clear on has false-alarm probability <= gamma given the same
calibration event. A flag rate between b and c may clear and raise the alarm in turn.

**The order it is fed in** (`ArrivalFeed`). The bets are valid only when each is made on past
flags alone, and the flags arrive i.i.d. in the order they are fed. The order requests *decide*
in depends on their flags (a flagged request runs on with another policy, and the steps of the
requests around it shift), so the alarm is fed in the order requests **arrived**, fixed before
any of them decided: a request whose gate has not decided yet holds back the ones after it, and
one that ends before its gate decides gives up its place with no observation. Whether a request
reaches its gate step at all is a matter of its own first steps, as for the calibration split's
traces (whose gate features need as many steps), so the flags fed are those of requests like the
calibration split's that reached the gate.

Pure: no server import, so an offline replay of gate decisions runs the engine's very alarm.
"""

from __future__ import annotations

from dataclasses import dataclass

from orca_method.shift_gate import flag_count

DEFAULT_ALARM_LEVEL = 0.01  # P(ever alarm) on in-distribution traffic, eps + gamma
CLEAR_FACTOR = 2.0  # the alarm clears once the flag rate is shown below this many times b
BETS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)  # fractions of the wealth bet (mixed equally)


def flag_rate_bound(n: int, alpha: float, eps: float) -> float:
    """b: the gate's flag rate given its calibration set is <= b with probability >= 1 - eps
    over n calibration scores (the Beta(m, n + 1 - m) quantile at 1 - eps, module docstring);
    0 when the gate flags nothing at alpha (m = 0), 1 when it flags everything."""
    from scipy.stats import beta as beta_dist  # deferred: the serving contract reads the level

    m = flag_count(n, alpha)
    if m <= 0:
        return 0.0
    if m >= n + 1:
        return 1.0
    return float(beta_dist.ppf(1.0 - eps, m, n + 1 - m))


class _ChangePointWealth:
    """Wealth of the bets BETS on x - target (sign +1: that x runs above the target; -1:
    below), mixed equally over the bets and over start requests k with weights
    w_k = 1 / (k (k + 1)): sum_k w_k prod_{k <= s <= t} factor_s, a start not reached yet
    holding its stake w_k. Kept per bet as running[j] = sum_{k <= t} w_k prod_{k <= s <= t}
    factor_s, so one request costs O(len(BETS)). Under the null every product is a
    nonnegative supermartingale, so their mixture (weights summing to 1) is one from 1."""

    def __init__(self, target: float, sign: int) -> None:
        self.target, self.sign = target, sign
        # the largest bet that keeps every factor >= 0 is 1 / target (above) or 1 / (1 - target)
        self.scale = 1.0 / (target if sign > 0 else 1.0 - target)
        self.running = [0.0] * len(BETS)
        self.t = 0

    def update(self, x: float) -> float:
        """Bet on one more observation x in {0, 1}; returns the mixture's wealth."""
        self.t += 1
        w = 1.0 / (self.t * (self.t + 1))
        d = self.sign * (x - self.target)
        self.running = [(r + w) * (1.0 + f * self.scale * d)
                        for r, f in zip(self.running, BETS)]
        return self.wealth

    @property
    def wealth(self) -> float:
        not_started = 1.0 / (self.t + 1)  # sum_{k > t} w_k: those bets still hold their stake
        return sum(self.running) / len(BETS) + not_started


@dataclass(frozen=True)
class AlarmChange:
    """What one observation did to the alarm (neither: nothing changed)."""

    raised: bool = False
    cleared: bool = False


NO_CHANGE = AlarmChange()  # what almost every observation returns (frozen: one instance serves)


class GateAlarm:
    """The alarm on one gate's stream of decisions (module docstring). `observe` each request's
    conformal p-value once, in arrival order (`ArrivalFeed`); read `alarmed` when serving."""

    def __init__(self, n_cal: int, alpha: float, level: float = DEFAULT_ALARM_LEVEL) -> None:
        if not 0 < level < 1:
            raise ValueError(f"the gate alarm's level must be in (0, 1), got {level}")
        self.n_cal, self.alpha, self.level = int(n_cal), float(alpha), float(level)
        self.m = flag_count(self.n_cal, self.alpha)
        eps = gamma = level / 2
        self.bound = flag_rate_bound(self.n_cal, self.alpha, eps)
        self.clear_rate = min(CLEAR_FACTOR * self.bound, (1.0 + self.bound) / 2)
        self.threshold = 1.0 / gamma
        self.alarmed = False
        self.seen = self.flags = self.raised = self.cleared = 0
        self.since: int | None = None  # requests seen when the alarm was last raised
        # no test when the gate cannot flag at this alpha (b = 0) or flags everything (b = 1)
        self._test = self._detector() if self.usable else None

    @property
    def usable(self) -> bool:
        """Whether the gate can flag at all at this alpha (else there is nothing to test)."""
        return 0 < self.bound < 1

    def flagged(self, pvalue: float) -> bool:
        """The gate's own decision at the alarm's alpha from a request's p-value
        (1 + #{s_i >= s}) / (n + 1): flagged iff 1 + #{s_i >= s} <= m (`shift_gate`)."""
        return round(pvalue * (self.n_cal + 1)) <= self.m

    def observe(self, pvalue: float) -> AlarmChange:
        """One request's gate p-value in; whether that raised or cleared the alarm."""
        x = 1.0 if self.flagged(pvalue) else 0.0
        self.seen += 1
        self.flags += int(x)
        if self._test is None:
            return NO_CHANGE
        if self._test.update(x) < self.threshold:
            return NO_CHANGE
        self.alarmed = not self.alarmed
        self._test = self._clearer() if self.alarmed else self._detector()
        if self.alarmed:
            self.raised += 1
            self.since = self.seen
            return AlarmChange(raised=True)
        self.cleared += 1
        return AlarmChange(cleared=True)

    @property
    def wealth(self) -> float:
        """The running test's wealth (detection while clear, clearing while raised)."""
        return 1.0 if self._test is None else self._test.wealth

    def _detector(self) -> _ChangePointWealth:
        return _ChangePointWealth(self.bound, +1)

    def _clearer(self) -> _ChangePointWealth:
        return _ChangePointWealth(self.clear_rate, -1)


class ArrivalFeed:
    """A `GateAlarm` fed in arrival order (module docstring, "The order it is fed in"): each
    request takes a `ticket` when it arrives and hands back its gate's p-value when the gate
    decides (`decided`; None: it ended first and gives its place up)."""

    def __init__(self, alarm: GateAlarm) -> None:
        self.alarm = alarm
        self._issued = 0  # tickets handed out
        self._fed = 0  # the next ticket the alarm waits for
        self._done: dict[int, float | None] = {}  # decided, waiting for an earlier ticket

    @property
    def alarmed(self) -> bool:
        return self.alarm.alarmed

    @property
    def waiting(self) -> int:
        """Tickets handed out whose p-value the alarm has not read yet."""
        return self._issued - self._fed

    def ticket(self) -> int:
        """A new request's place in the arrival order."""
        self._issued += 1
        return self._issued - 1

    def decided(self, ticket: int, pvalue: float | None) -> list[AlarmChange]:
        """Request `ticket`'s gate p-value (None: no decision, skipped): feed it and every later
        one already decided, in order; the changes that made to the alarm (most often none)."""
        self._done[ticket] = pvalue
        changes = []
        while self._fed in self._done:
            p = self._done.pop(self._fed)
            self._fed += 1
            if p is None:
                continue
            change = self.alarm.observe(p)
            if change.raised or change.cleared:
                changes.append(change)
        return changes


def requests_to_alarm(alarm: GateAlarm, flags: list[bool] | tuple[bool, ...]) -> int | None:
    """Requests fed until `alarm` is raised (1-based), feeding p-values that decide `flags`
    (a replay of gate decisions); None if it never is."""
    hi, lo = 1.0 / (alarm.n_cal + 1), 1.0
    for i, f in enumerate(flags, 1):
        if alarm.observe(hi if f else lo).raised:
            return i
    return None

