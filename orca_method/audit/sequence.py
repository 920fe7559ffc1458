"""An anytime-valid confidence sequence for the mean of [0, 1] losses (the live risk).

The audit watches the realized risk continuously, so a fixed-n interval (Clopper-Pearson,
Hoeffding) would be broken by the watching itself: checking it after every audit and raising an
alarm the first time it excludes the truth has a false-alarm probability that grows to 1. A
confidence sequence is a sequence of intervals ``[lower_t, upper_t]`` that contains the true mean
at ALL sample sizes at once with probability >= 1 - alpha, so it may be looked at after every
update and stopped at any data-dependent time.

Construction: the hedged capital process of Waudby-Smith & Ramdas (2024), "Estimating means of
bounded random variables by betting", JRSS-B 86(1), section 4 ("hedged capital", Theorem 3),
with their predictable plug-in bets (eq. 26 there):

    K+_t(m) = prod_i (1 + l+_i(m) (X_i - m)),      K-_t(m) = prod_i (1 - l-_i(m) (X_i - m)),
    l_t = sqrt(2 log(2/alpha) / (s2_{t-1} t log(1 + t))),
    l+_t(m) = min(l_t, c/m),  l-_t(m) = min(l_t, c/(1-m)),     c = 1/2,
    mu_t = (1/2 + sum_{i<=t} X_i) / (t + 1),   s2_t = (1/4 + sum_{i<=t} (X_i - mu_i)^2) / (t + 1).

For the true mean m*, K+ and K- are nonnegative martingales (the bets are predictable and keep
every factor positive), so by Ville's inequality P(exists t: K+_t(m*) >= 2/alpha) <= alpha/2, and
the same for K-. The set {m : K+_t(m) < 2/alpha and K-_t(m) < 2/alpha} (the hedged process with
theta = 1/2) therefore covers m* at every t with probability >= 1 - alpha. K+ is nonincreasing
and K- nondecreasing in m, so the set is an interval: ``lower`` is the largest grid point that
K+ excludes, ``upper`` the smallest one that K- excludes (conservative by at most one grid
step). The bounds are those of the current set, not intersected over time: intersecting is
also valid but makes an alarm permanent and, after a rare miss, the interval empty; without it
an alarm clears when the evidence weakens, and every reading is still covered jointly.

Each side alone has level alpha/2: ``alarm(delta) = lower > delta`` fires, when the true risk is
at most delta, with probability at most alpha/2 over the whole (infinite) stream.

The state is a few arrays over a fixed grid of ``grid_size`` candidate means (O(grid) per update,
deterministic), optionally batched over independent streams (``shape``), which the coverage test
uses to simulate many streams with the very same code.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

C_TRUNCATION = 0.5  # c in the bets' truncation c/m, c/(1-m); the paper suggests 1/2 or 3/4
DEFAULT_GRID = 501  # candidate means 0, 0.002, ..., 1
FOLD = 32  # updates between two folds of the capital products into their logs


class ConfidenceSequence:
    """Running mean of [0, 1] losses with anytime-valid ``lower``/``upper`` bounds at ``alpha``.

    ``alpha`` is the probability that the bounds EVER miss the true mean (two-sided). The
    server's alarm (``RestartedAlarm``) runs a family of them whose levels sum to ``epsilon`` of
    the bundle, the level LTT used, so the audit's false-alarm probability (``epsilon/2``) is
    no larger than the calibration's own.
    """

    def __init__(self, alpha: float = 0.05, grid_size: int = DEFAULT_GRID,
                 shape: tuple[int, ...] = ()) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if grid_size < 2:
            raise ValueError(f"grid_size must be >= 2, got {grid_size}")
        self.alpha = float(alpha)
        self.grid_size = int(grid_size)
        self.shape = tuple(shape)
        self.grid = np.linspace(0.0, 1.0, self.grid_size)
        with np.errstate(divide="ignore"):
            self._cap_plus = C_TRUNCATION / self.grid  # inf at m = 0
            self._cap_minus = C_TRUNCATION / (1.0 - self.grid)  # inf at m = 1
        self._threshold = math.log(2.0 / self.alpha)  # log(1 / (theta alpha)), theta = 1/2
        self.n = 0
        self._sum = np.zeros(self.shape)
        self._sum_sq = np.zeros(self.shape)  # sum (X_i - mu_i)^2
        self._log_plus = np.zeros(self.shape + (self.grid_size,))  # log K+ at the last fold
        self._log_minus = np.zeros(self.shape + (self.grid_size,))  # log K- at the last fold
        self._prod_plus = np.ones_like(self._log_plus)  # K+ / exp(log K+ at the last fold)
        self._prod_minus = np.ones_like(self._log_minus)
        self._fold()
        self._lower = np.zeros(self.shape)
        self._upper = np.ones(self.shape)
        # _tighten's lookups: the bound for k points excluded from below (k = 0: none, 0.0)
        # and from above (k = 0: none, 1.0); the kept-point masks carry one more point that is
        # always kept, so that the first kept point is G when none of the grid is
        self._lower_of = np.concatenate(([0.0], self.grid))  # [G + 1]
        self._upper_of = np.concatenate(([1.0], self.grid[::-1]))  # [G + 1]
        self._kept_low = np.ones(self.shape + (self.grid_size + 1,), dtype=bool)
        self._kept_high = np.ones_like(self._kept_low)

    # -- updates ----------------------------------------------------------------------------
    def update(self, loss: float | np.ndarray) -> None:
        """Add one loss in [0, 1] (per stream, when batched)."""
        x = np.asarray(loss, dtype=float)
        if x.shape != self.shape:
            raise ValueError(f"expected a loss of shape {self.shape}, got {x.shape}")
        if not np.all((x >= 0.0) & (x <= 1.0)):
            raise ValueError("losses must be in [0, 1]")
        t = self.n + 1
        var_prev = (0.25 + self._sum_sq) / t  # s2_{t-1}
        bet = np.sqrt(2.0 * self._threshold / (var_prev * t * math.log1p(t)))[..., None]
        diff = np.subtract(x[..., None], self.grid)  # [*shape, G]: X - m
        factor = np.minimum(bet, self._cap_plus)  # [*shape, G], then 1 + l+ (X - m) in place
        factor *= diff
        factor += 1.0
        self._prod_plus *= factor
        np.negative(diff, out=diff)  # m - X: l- (m - X) is -(l- (X - m)) exactly
        np.minimum(bet, self._cap_minus, out=factor)  # then 1 - l- (X - m) in place
        factor *= diff
        factor += 1.0
        self._prod_minus *= factor
        self._sum += x
        self._sum_sq += (x - (0.5 + self._sum) / (t + 1)) ** 2
        self.n = t
        self._tighten()
        if t % FOLD == 0:
            self._fold()

    def _fold(self) -> None:
        """Move the products of the last factors into the logs (exact up to rounding).

        Products instead of a log per factor: a float64 log per grid point and update is what
        the update would cost otherwise. Every factor lies in [1 - c, 1 + max bet], max bet
        <= sqrt(8 log(2/alpha) / log 2), so FOLD factors neither overflow nor underflow.
        """
        self._log_plus += np.log(self._prod_plus)
        self._log_minus += np.log(self._prod_minus)
        self._prod_plus = np.ones_like(self._log_plus)
        self._prod_minus = np.ones_like(self._log_minus)
        # K >= 2/alpha  <=>  product since the fold >= exp(threshold - log K at the fold);
        # inf (overflow) where the capital fell so low that no product can reach it
        with np.errstate(over="ignore"):
            self._need_plus = np.exp(self._threshold - self._log_plus)
            self._need_minus = np.exp(self._threshold - self._log_minus)

    def _tighten(self) -> None:
        """The bounds from the grid points the capital processes exclude: the leading run for
        K+ and the trailing run for K-, found with argmax (the first point NOT excluded), so
        float noise in the monotonicity in m never excludes an interior point."""
        g = self.grid_size
        np.less(self._prod_plus, self._need_plus, out=self._kept_low[..., :g])
        np.less(self._prod_minus[..., ::-1], self._need_minus[..., ::-1],
                out=self._kept_high[..., :g])
        # grid points 0..k_low-1 are excluded, and the last k_high ones (G: all of them)
        self._lower = self._lower_of[self._kept_low.argmax(axis=-1)]
        self._upper = self._upper_of[self._kept_high.argmax(axis=-1)]

    # -- reading ----------------------------------------------------------------------------
    def _out(self, a: np.ndarray) -> float | np.ndarray:
        return float(a) if self.shape == () else a.copy()

    @property
    def mean(self) -> float | np.ndarray:
        """Realized mean loss (NaN before the first update)."""
        return self._out(self._sum / self.n if self.n else np.full(self.shape, math.nan))

    @property
    def lower(self) -> float | np.ndarray:
        return self._out(self._lower)

    @property
    def upper(self) -> float | np.ndarray:
        return self._out(self._upper)

    def alarm(self, delta: float) -> bool | np.ndarray:
        """True when the risk exceeds ``delta`` at level alpha/2, uniformly over time."""
        out = self._lower > delta
        return bool(out) if self.shape == () else out

    # -- persistence ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready state; ``from_dict`` restores it exactly (floats round-trip in JSON)."""
        self._fold()
        return {"kind": "hedged-capital-wsr2024", "alpha": self.alpha,
                "grid_size": self.grid_size, "shape": list(self.shape), "n": self.n,
                "sum": self._sum.tolist(), "sum_sq": self._sum_sq.tolist(),
                "log_plus": self._log_plus.tolist(), "log_minus": self._log_minus.tolist(),
                "lower": self._lower.tolist(), "upper": self._upper.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConfidenceSequence:
        if d.get("kind") != "hedged-capital-wsr2024":
            raise ValueError(f"not a confidence sequence state: kind {d.get('kind')!r}")
        cs = cls(alpha=d["alpha"], grid_size=d["grid_size"], shape=tuple(d["shape"]))
        cs.n = int(d["n"])
        for name in ("sum", "sum_sq", "log_plus", "log_minus", "lower", "upper"):
            value = np.asarray(d[name], dtype=float)
            current = getattr(cs, f"_{name}")
            if value.shape != current.shape:
                raise ValueError(f"confidence sequence state '{name}' has shape {value.shape}, "
                                 f"expected {current.shape}")
            setattr(cs, f"_{name}", value)
        cs._fold()
        return cs


RESTART_EVERY = 50  # audits between the starts of two members of the alarm's family
RESTART_SPAN = 4  # member j lives span * 2^v(j) restarts (v: the power of 2 dividing j)


def two_adic(j: int) -> int:
    """v(j): the exponent of the largest power of 2 that divides j (j >= 1)."""
    return (j & -j).bit_length() - 1


class RestartedAlarm:
    """The audit's alarm: a family of confidence sequences restarted every ``every`` audits.

    One sequence over all audits since the start answers "has the risk been at most delta all
    along?", so after a long clean history a sudden shift must outweigh that history before its
    lower bound passes delta (measured: the delay grows about linearly with the clean history).
    The family asks the same question of every recent stretch: member j starts after audit
    ``j * every`` (j = 0, 1, 2, ...) with two-sided level ``alpha_j = epsilon / ((j+1)(j+2))``,
    and the alarm for delta fires when ANY live member's lower bound exceeds delta.

    Validity: if the conditional risk of every audit is at most delta, member j's lower-side
    capital at m = delta is a nonnegative supermartingale from its start (each factor
    1 + l (X - delta) has conditional mean <= 1, the bet l >= 0 being predictable), so by
    Ville's inequality it ever alarms with probability <= alpha_j / 2, and by the union bound
    the family ever alarms with probability <= sum_j alpha_j / 2 = epsilon / 2: the false-alarm
    level of one whole-history sequence at alpha = epsilon. Dropping members removes tests and
    keeps the bound. This is the restart ("e-detector") construction of change detection with
    e-processes (Shin, Ramdas & Rinaldo 2023, "E-detectors: a nonparametric framework for
    sequential change detection").

    Which members live (dyadic ages, to bound the cost without bounding the reach): member 0
    always; member j >= 1 while fewer than ``span * 2^v(j)`` restarts followed it, v(j) the
    power of 2 in j. Why it keeps the delay bounded by the shift's own statistics: for a shift
    d >= 2 every audits ago, the power of 2 with ``d/(4 every) < 2^v <= d/(2 every)`` has a
    multiple among the restarts of the first half of the shifted stretch, and that member is
    still alive (span = 4), so some live member holds at least half of the shifted audits and
    none from before. Live members: about ``span/2 * log2(restarts)`` (16 after 10,000 audits
    at every = 50). What still grows with the history is the member's level (alpha_j falls like
    1/j^2, its threshold log(2/alpha_j) grows like 2 log j): logarithmically, the price of
    bounding the probability of a false alarm over an unbounded stream.

    ``n``, ``mean``, ``lower`` and ``upper`` are member 0's (the whole history, at level
    epsilon/2, so the displayed interval covers the risk at every time with probability
    >= 1 - epsilon/2); ``alarm_source`` says which member alarmed. Batched over ``shape`` like
    ConfidenceSequence.
    """

    def __init__(self, epsilon: float = 0.05, every: int = RESTART_EVERY,
                 span: int = RESTART_SPAN, grid_size: int = DEFAULT_GRID,
                 shape: tuple[int, ...] = ()) -> None:
        if every < 1 or span < 1:
            raise ValueError(f"every and span must be >= 1, got {every}, {span}")
        self.epsilon, self.every, self.span = float(epsilon), int(every), int(span)
        self.grid_size, self.shape = int(grid_size), tuple(shape)
        self.members: list[tuple[int, ConfidenceSequence]] = []  # (start audit, sequence)
        self._start(0)

    def _start(self, j: int) -> None:
        alpha = self.epsilon / ((j + 1) * (j + 2))
        self.members = [(s, cs) for s, cs in self.members
                        if s == 0 or j - s // self.every < self.span * 2 ** two_adic(s // self.every)]
        self.members.append((j * self.every, ConfidenceSequence(alpha, self.grid_size,
                                                                self.shape)))

    def update(self, loss: float | np.ndarray) -> None:
        """Add one loss to every live member, first starting a member every ``every`` audits."""
        if self.n and self.n % self.every == 0:
            self._start(self.n // self.every)
        for _, cs in self.members:
            cs.update(loss)

    @property
    def n(self) -> int:
        return self.members[0][1].n

    @property
    def mean(self) -> float | np.ndarray:
        return self.members[0][1].mean

    @property
    def lower(self) -> float | np.ndarray:
        return self.members[0][1].lower

    @property
    def upper(self) -> float | np.ndarray:
        return self.members[0][1].upper

    def _fired(self, delta: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per stream: start and lower bound of the alarming member with the largest lower
        bound (-1 and NaN where none alarms). ``delta`` may be one per stream."""
        lowers = np.stack([np.asarray(cs.lower) for _, cs in self.members])  # [M, *shape]
        starts = np.array([s for s, _ in self.members])  # [M]
        strength = np.where(lowers > delta, lowers, -np.inf)
        best = strength.argmax(axis=0)  # [*shape]
        fired = np.isfinite(np.take_along_axis(strength, best[None], axis=0)[0])
        return (np.where(fired, starts[best], -1),
                np.where(fired, np.take_along_axis(lowers, best[None], axis=0)[0], np.nan))

    def alarm(self, delta: float | np.ndarray) -> bool | np.ndarray:
        """True when some member's lower bound exceeds ``delta`` (false-alarm level epsilon/2)."""
        since, _ = self._fired(delta)
        return bool(since >= 0) if self.shape == () else since >= 0

    def alarm_source(self, delta: float | np.ndarray) -> tuple[Any, Any]:
        """(start audit, lower bound) of the member behind the alarm: the one with the largest
        lower bound among those above ``delta``; (None, None) without an alarm. Batched: arrays,
        -1 and NaN where no member alarms."""
        since, lower = self._fired(delta)
        if self.shape != ():
            return since, lower
        return (None, None) if since < 0 else (int(since), float(lower))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready state (the live members' sequences); ``from_dict`` restores it."""
        return {"kind": "restarted-alarm", "epsilon": self.epsilon, "every": self.every,
                "span": self.span, "grid_size": self.grid_size, "shape": list(self.shape),
                "members": [[start, cs.to_dict()] for start, cs in self.members]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RestartedAlarm:
        if d.get("kind") != "restarted-alarm":
            raise ValueError(f"not a restarted alarm state: kind {d.get('kind')!r}")
        fam = cls(d["epsilon"], d["every"], d["span"], d["grid_size"], tuple(d["shape"]))
        fam.members = [(int(start), ConfidenceSequence.from_dict(cs)) for start, cs in d["members"]]
        return fam


class CensoredAlarm:
    """The guard's statistics when some audits' losses are unknown (censored, `censored=True`).

    An audit cut by max_tokens or aborted has no natural end, so its loss at a threshold whose
    stop would come after the cut is unknown; leaving it out biases the risk low exactly when
    being cut goes with being wrong (hard problems run long). (At a threshold that stops before
    the cut its loss is known and it enters uncensored: `orca_method.audit.guards.cut_feed`.)
    Its loss is only known to lie in [0, `worst`], so it enters twice, at both ends:

    - the ALARM (`RestartedAlarm`, lower bounds) counts it as loss 0. Each loss fed there is
      at most the audit's true loss, so the fed mean is at most the traffic's risk, and a lower
      bound above delta still establishes risk > delta at the alarm's level (epsilon / 2);
    - the UPPER bound (a `ConfidenceSequence` at epsilon / 2, the level of the alarm's member
      0) counts it as loss `worst`: 1 (any loss) for an aborted audit; for a cut one, the loss
      of the population calibration certified, where the cut is the trajectory's end
      (docs/METHOD.md section 10). The fed mean is at least that risk, so the upper bound, and
      the clearing that reads it, stay on the safe side for it.

    The displayed interval [lower, upper] (member 0's lower bound, the upper sequence's upper
    bound; each side at level epsilon / 4) covers the certified risk at all times with
    probability >= 1 - epsilon / 2, however being cut depends on the loss. The price: the
    alarm sees the risk less the censored audits' share of it.

    `mean` is the mean over the uncensored audits; `risk_range` the means with censored audits
    at 0 and at 1. Batched over `shape` like `RestartedAlarm` (the simulations use it).
    """

    def __init__(self, epsilon: float = 0.05, every: int = RESTART_EVERY,
                 span: int = RESTART_SPAN, grid_size: int = DEFAULT_GRID,
                 shape: tuple[int, ...] = ()) -> None:
        self.shape = tuple(shape)
        self.alarm_side = RestartedAlarm(epsilon, every, span, grid_size, self.shape)
        self.upper_side = ConfidenceSequence(epsilon / 2, grid_size, self.shape)
        self._censored = np.zeros(self.shape, dtype=np.int64)

    def update(self, loss: float | np.ndarray, censored: bool | np.ndarray = False,
               worst: float | np.ndarray = 1.0) -> None:
        """One audit per stream: its loss, or (where `censored`) an unknown loss in
        [0, `worst`] (the value passed as `loss` there is ignored). `worst` is 1 but where the
        censored loss is bounded by what the population certified counts (a cut audit at a
        threshold that stops at the cut: `orca_method.audit.guards.cut_feed`)."""
        cut = np.broadcast_to(np.asarray(censored, dtype=bool), self.shape)
        x = np.where(cut, 0.0, np.asarray(loss, dtype=float))
        self.alarm_side.update(x)
        self.upper_side.update(np.where(cut, np.asarray(worst, dtype=float), x))
        self._censored = self._censored + cut

    def _out(self, a: np.ndarray) -> Any:
        return a.item() if self.shape == () else a

    @property
    def n(self) -> int:
        return self.alarm_side.n

    @property
    def censored(self) -> int | np.ndarray:
        """Audits counted with an unknown loss (per stream)."""
        return self._out(self._censored)

    @property
    def mean(self) -> float | np.ndarray:
        """Mean loss of the uncensored audits (NaN before the first one)."""
        finished = self.n - self._censored
        with np.errstate(invalid="ignore", divide="ignore"):
            out = np.where(finished > 0, np.asarray(self.alarm_side.mean) * self.n
                           / np.maximum(finished, 1), np.nan)
        return self._out(np.asarray(out, dtype=float))

    @property
    def risk_range(self) -> tuple[Any, Any]:
        """(mean with every censored audit at loss 0, mean with them at loss 1): what their
        unknown losses could make the mean, the cut ones' included (the upper bound counts a cut
        one at its loss at the cut, the certified population's)."""
        low = self.alarm_side.mean
        return low, self._out(np.asarray(low) + self._censored / max(self.n, 1))

    @property
    def lower(self) -> float | np.ndarray:
        return self.alarm_side.lower

    @property
    def upper(self) -> float | np.ndarray:
        return self.upper_side.upper

    def alarm(self, delta: float | np.ndarray) -> bool | np.ndarray:
        """True when the risk, censored audits counted at loss 0, exceeds ``delta`` (see
        RestartedAlarm; false-alarm level epsilon / 2 for the whole traffic's risk)."""
        return self.alarm_side.alarm(delta)

    def alarm_source(self, delta: float | np.ndarray) -> tuple[Any, Any]:
        return self.alarm_side.alarm_source(delta)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready state; ``from_dict`` restores it (the audit journal's snapshots)."""
        return {"kind": "censored-alarm", "alarm_side": self.alarm_side.to_dict(),
                "upper_side": self.upper_side.to_dict(), "censored": self._censored.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CensoredAlarm:
        if d.get("kind") != "censored-alarm":
            raise ValueError(f"not a censored alarm state: kind {d.get('kind')!r}")
        out = cls.__new__(cls)
        out.alarm_side = RestartedAlarm.from_dict(d["alarm_side"])
        out.upper_side = ConfidenceSequence.from_dict(d["upper_side"])
        out.shape = out.alarm_side.shape
        out._censored = np.asarray(d["censored"], dtype=np.int64)
        return out
