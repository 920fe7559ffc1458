"""The guards' decisions: per delta, the lambda served from the audited risk; per give-up delta,
whether requests give up; per consensus row, whether voted groups settle early.

Pure: each guard is fed losses (or the scores to take them from) and its statistics
(`orca_method.audit.sequence`), and decides; the server (`orca_serve/live_audit/`) folds its
journalled audit events into them, the simulations call them directly. docs/AUDIT.md, "What an
alarm means", "Recalibration in the server", "The give-up risk", "The vote's audit".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from orca_method.audit.attrition import Cause
from orca_method.audit.drift import DriftMonitor, build_reference
from orca_method.audit.martingale import ConformalMartingale
from orca_method.audit.sequence import CensoredAlarm
from orca_method.bundle import DriftReference
from orca_method.give_up import (
    calibrate_give_up,
    mu_grid,
    request_consistency_give_up_loss,
    request_give_up_loss,
)
from orca_method.ltt import DEFAULT_EPSILON, calibrate, default_grid
from orca_method.outcomes import GiveUpPolicy, OnAlarm, PValue, Source
from orca_method.risk import request_loss, stops_before_end
from orca_method.thresholds import GIVE_UP_NEVER, NEVER, lam_from_json, lam_to_json, mu_from_json


class CS(Protocol):
    """What the guard needs of its statistics (orca_method.audit.sequence.CensoredAlarm): the whole
    history's mean and bounds, the audits counted with an unknown loss, and the alarm."""

    n: int
    censored: int
    mean: float
    lower: float
    upper: float

    def update(self, loss: float, censored: bool = False, worst: float = 1.0) -> None: ...

    def alarm(self, delta: float) -> bool: ...

    def alarm_source(self, delta: float) -> tuple[int | None, float | None]: ...


def aligned_scores(scores: Iterable[float], n_steps: int) -> np.ndarray | None:
    """The online scores as one score per recorded step, or None when they cannot be.

    The plugin scores every completed reasoning step except the one the end of thinking closes
    (and a step cut off by max_tokens), so it reports n_steps or n_steps - 1 scores. The last
    step's score never changes a stop time (not crossing lambda also stops at the last step), so a
    missing last score is filled with 0.
    """
    s = np.asarray(list(scores), dtype=float)
    if len(s) not in (n_steps, n_steps - 1) or not np.all((s >= 0) & (s <= 1)):
        return None
    return np.concatenate([s, np.zeros(n_steps - len(s))])


# what one audit feeds a guard's statistics at one threshold: CS.update's (loss, censored, worst)
Feed = tuple[float, bool, float]
UNKNOWN: Feed = (0.0, True, 1.0)  # censored without a usable recording: any loss in [0, 1]


def cut_feed(scores: np.ndarray, labels: np.ndarray, lam: float, cause: str | None,
             loss: Callable[[np.ndarray, np.ndarray, float], int] = request_loss) -> Feed:
    """What an audit that did not finish (cut or aborted) with a recording feeds at `lam`.

    Its scores and cumulative labels run up to where it ended. When the procedure under `lam`
    stops before that end (`stops_before_end`), the request under `lam` would have answered at
    that stop, whatever came after, and the label there says whether that answer is right: the
    loss is known and enters uncensored. When it would stop later, the loss is unknown:
    censored, with `worst` 1 for an aborted audit and, for one cut by max_tokens (`cause`
    `Cause.CUT`), the loss at the cut (the last recorded step), which is the loss of the population
    calibration certified, where a cut trajectory ends at its cut (docs/METHOD.md section 10).
    """
    x = loss(scores, labels, lam)
    if stops_before_end(scores, lam):
        return float(x), False, 1.0
    return 0.0, True, float(x) if cause == Cause.CUT else 1.0


def ltt_lambda(scores: list[np.ndarray], labels: list[np.ndarray], delta: float, *,
               epsilon: float, grid_size: int, pvalue: PValue) -> float:
    """lambda* for `delta` by the calibration code's LTT (orca_method/ltt.py) on these audits."""

    (res,) = calibrate(scores, labels, [delta], epsilon=epsilon, grid=default_grid(grid_size),
                       pvalue=pvalue)
    return res.lam


def ltt_mu(scores: list[np.ndarray], labels: list[np.ndarray], delta: float, *,
           epsilon: float, grid_size: int, pvalue: PValue, policy: GiveUpPolicy) -> float:
    """mu* for the give-up risk `delta` by calibration's LTT over mu (orca_method/give_up.py)
    on these audits' give-up scores, certified for the give-up loss under their (raw)
    consistency labels (`orca_method.give_up.changed_by_giving_up`)."""
    (res,) = calibrate_give_up(scores, [], [delta], epsilon=epsilon, grid=mu_grid(grid_size),
                               pvalue=pvalue, policy=policy, consistency=labels)
    return res.mu


def window_lambda(scores: list[np.ndarray], labels: list[np.ndarray], delta: float,
                  epsilon: float,
                  ltt: Callable[[list[np.ndarray], list[np.ndarray], float, float], float]
                  ) -> float:
    """The lambda a recalibration serves: the larger of LTT's on the whole window and on its
    most recent half (the window in admission order).

    Valid at `epsilon` with no split: every request's loss, so the risk, only falls as lambda
    grows, so a lambda at or above one LTT certified at `epsilon` is certified too (the floor's
    argument). Under a continuing drift the window's older half comes from traffic further from
    what follows, and the lambda certified on the whole of it went bad at or soon after its
    first request (benchmarks/RESULTS-archive.md, "The live audit's repair"); its recent half
    then asks for the larger lambda. On unchanged traffic the half's lambda is larger only when
    its draw is unlucky: the price is savings, never the guarantee."""
    half = len(scores) // 2
    return max(ltt(scores, labels, delta, epsilon),
               ltt(scores[half:], labels[half:], delta, epsilon))


def recalibration_epsilon(epsilon: float, k: int) -> float:
    """The level of a delta's k-th recalibration (k >= 1): epsilon / (k (k + 1)).

    These sum to epsilon over k, so the probability that ANY recalibration of a delta certifies
    a lambda whose risk exceeds delta stays at most epsilon (union bound), however many alarms a
    deployment sees.
    """
    return epsilon / (k * (k + 1))


Window = tuple[list[np.ndarray], list[np.ndarray]]


class Served(Protocol):
    """A recalibrated threshold a guard serves: what `recalibration` reads of it, its alarm."""

    cs: CS


R = TypeVar("R", bound=Served)


def engagement(engaged: bool, cs: CS, delta: float) -> bool:
    """Whether a guard is engaged after its latest audit: on an alarm, and until no member
    alarms any more AND the whole history's upper bound is back at delta or below (evidence
    that the bundle's threshold holds again), not when a lower bound merely dips: that would
    flap with every loss near the boundary."""
    if cs.n and cs.alarm(delta):
        return True
    return engaged and cs.upper > delta


class Recalibrating(Protocol[R]):
    """What `recalibration` reads and moves of a guard (`DeltaGuard`, `GiveUpGuard`): its
    alarm's statistics and level, its split of epsilon, and the recalibration it serves."""

    delta: float
    cs: CS
    epsilon: float
    engaged: bool
    waiting_since: int | None
    recalibrations: int
    served: R | None


def recalibration(g: Recalibrating[R], now: int, window: Callable[[int], Window | None],
                  certify: Callable[[int, float, Window], R]) -> Source:
    """One `recalibrate` decision of a guard, the stop side's and the give-up side's alike
    (docs/AUDIT.md, "Recalibration in the server"): the bundle's alarm (once) or the served
    threshold's own alarm starts a wait at `now`; once `window(since)` has the audits admitted
    after it, the k-th recalibration certifies on them alone at `recalibration_epsilon(epsilon,
    k)` (`certify(k, epsilon_k, window)`, the side's own threshold and its fresh alarm) and is
    served. Returns where the served threshold comes from: FALLBACK while waiting, AUDIT once
    recalibrated, BUNDLE before any alarm."""
    served_alarm = g.served is not None and bool(g.served.cs.n) and bool(
        g.served.cs.alarm(g.delta))
    if (not g.engaged and bool(g.cs.n) and g.cs.alarm(g.delta)) or served_alarm:
        g.engaged, g.waiting_since, g.served = True, now, None
    if g.waiting_since is not None:
        data = window(g.waiting_since)
        if data is None:
            return Source.FALLBACK
        k = g.recalibrations + 1
        g.served = certify(k, recalibration_epsilon(g.epsilon, k), data)
        g.recalibrations, g.waiting_since = k, None
    return Source.BUNDLE if g.served is None else Source.AUDIT


@dataclass
class Recalibrated:
    """A lambda the guard serves after a recalibration, and the audit of that lambda."""

    k: int  # the delta's k-th recalibration
    epsilon: float  # LTT's level for it (recalibration_epsilon)
    lam: float
    since: int  # audits admitted after this admission number measure it
    cs: CS  # its own alarm (a fresh CensoredAlarm)
    # the scores of the window it was certified on, as a drift reference: while the live
    # scores differ from them, the lambda is not trusted (DeltaGuard.distrusted)
    drift: DriftMonitor | None = None
    # the sequential test against the same reference: its alarm (journalled) makes the guard
    # recalibrate anew (DeltaGuard.drift_alarm)
    sequential: ConformalMartingale | None = None


@dataclass
class DeltaGuard:
    """One delta's realized risk (at the bundle's lambda*) and the lambda it is served with.

    `recalibrate` (docs/AUDIT.md, "Recalibration in the server"): on the bundle's alarm the
    guard falls back (never stops early) until `window` audits ADMITTED AFTER the alarm are
    labelled, runs LTT on those alone (and on their recent half: `window_lambda`) at
    `recalibration_epsilon(epsilon, k)` and serves that lambda (not below `floor`), then
    audits it with its own alarm; that alarm starts the next wait and recalibration. The bundle's lambda* does not return for this bundle (with a
    journal: not after a restart either).
    """

    delta: float
    bundle_lam: float  # inf = never stops early
    cs: CS
    on_alarm: OnAlarm = OnAlarm.REPORT
    epsilon: float = DEFAULT_EPSILON  # the bundle's, split across recalibrations
    floor: float = 0.0  # a recalibrated lambda is served at least this high
    drift_k: int = 10  # the drift statistics' early-mean steps (the bundle's smoothing window)
    lam: float = NEVER
    source: Source = Source.BUNDLE
    engaged: bool = False  # alarmed and not cleared yet
    waiting_since: int | None = None  # recalibrate: the admission number the wait began at
    recalibrations: int = 0
    served: Recalibrated | None = None
    distrusted: bool = False  # the served lambda's drift test alarms: fallback meanwhile
    # report / fallback after the bundle's sequential drift test alarmed: engaged until the
    # audits admitted after that admission number (`drift_cs`) bound the risk at delta or below
    drift_since: int | None = None
    drift_cs: CS | None = None

    def __post_init__(self) -> None:
        self.lam = self.bundle_lam
        self.on_alarm = OnAlarm(self.on_alarm)  # a name (the CLI's) becomes its OnAlarm

    @property
    def alarm(self) -> bool:
        """The realized risk of the bundle's lambda* exceeds delta (its lower bound does)."""
        return bool(self.cs.n) and bool(self.cs.alarm(self.delta))

    def observe(self, seq: int, feed: Callable[[float], Feed] | None) -> None:
        """One counted audit (admission number `seq`): what it feeds at the bundle's lambda*,
        and at the recalibrated lambda when the audit was admitted after that lambda took
        effect (`feed(lam)`: its loss, or censored, `cut_feed`). `feed` None: an audit whose
        loss is unknown at every threshold (UNKNOWN)."""
        self.cs.update(*(UNKNOWN if feed is None else feed(self.bundle_lam)))
        if self.drift_cs is not None and seq > self.drift_since:  # type: ignore[operator]
            self.drift_cs.update(*(UNKNOWN if feed is None else feed(self.bundle_lam)))
        if self.served is not None and seq > self.served.since:
            self.served.cs.update(*(UNKNOWN if feed is None else feed(self.served.lam)))

    def decide(self, now: int, window: Callable[[int], Window | None],
               ltt: Callable[[list[np.ndarray], list[np.ndarray], float, float], float],
               make_cs: Callable[[], CS]) -> None:
        """Set the served lambda from the alarms and the policy.

        `now`: audits admitted so far (later ones are "after" this decision); `window(after)`:
        the first `window` counted audits admitted after `after`, in admission order, once all
        of them are known, else None; `ltt(scores, labels, delta, epsilon)`: LTT's lambda.

        `report` and `fallback`: the guard engages on an alarm and is cleared only when no
        member alarms any more and the whole history's upper bound is back at delta or below
        (evidence that the bundle's lambda* holds again), not when the lower bound dips: that
        would flap with every loss near the boundary. After a sequential drift alarm
        (`drift_alarm`) they also hold until the audits admitted after it bound the risk at
        delta or below.
        """
        if self.on_alarm == OnAlarm.RECALIBRATE:
            self._recalibrate(now, window, ltt, make_cs)
            return self.trust()
        held = self.drift_cs is not None and not (self.drift_cs.n
                                                   and self.drift_cs.upper <= self.delta)
        if self.drift_cs is not None and not held:  # the traffic since the drift alarm is fine
            self.drift_since, self.drift_cs = None, None
        self.engaged = engagement(self.engaged, self.cs, self.delta) or held
        self._serve()

    def _serve(self) -> None:
        """`report` and `fallback`: the lambda an engaged guard serves, or the bundle's."""
        if self.engaged and self.on_alarm == OnAlarm.FALLBACK:
            self.lam, self.source = NEVER, Source.FALLBACK
        else:
            self.lam, self.source = self.bundle_lam, Source.BUNDLE

    def _recalibrate(self, now: int, window: Callable[[int], Window | None],
                     ltt: Callable[[list[np.ndarray], list[np.ndarray], float, float], float],
                     make_cs: Callable[[], CS]) -> None:
        def certify(k: int, eps: float, data: Window) -> Recalibrated:
            # the stop side's own: not below the floor, and the window's scores as the drift
            # reference the served lambda is watched against
            lam = max(window_lambda(data[0], data[1], self.delta, eps, ltt), self.floor)
            return Recalibrated(k, eps, lam, now, make_cs(), *self._window_drift(data[0]))

        self.source = recalibration(self, now, window, certify)
        self.lam = (NEVER if self.source == Source.FALLBACK else self.bundle_lam
                    if self.served is None else self.served.lam)

    def drift_alarm(self, now: int, k: int | None, make_cs: Callable[[], CS]) -> None:
        """A sequential drift test alarmed (`ConformalMartingale`; journalled, so every process
        folds it at the same place; `now`: audits admitted so far): the bundle's (`k` None,
        against the calibration split) or the one of this delta's k-th recalibrated lambda
        (against its window). The response is the alarm's (docs/AUDIT.md, "Sequential drift
        test"): `recalibrate` falls back and recalibrates on the first `window` audits admitted
        after now (the bundle's test only while the bundle's lambda* is served); `fallback`
        and `report` engage until the audits admitted after now bound the risk of the bundle's
        lambda* at delta or below."""
        if k is not None:
            if self.served is None or self.served.k != k:
                return  # a lambda no longer served
            self.waiting_since, self.served, self.distrusted = now, None, False
            self.lam, self.source = NEVER, Source.FALLBACK
        elif self.on_alarm == OnAlarm.RECALIBRATE:
            if self.engaged:
                return  # the bundle's lambda* is not served any more
            self.engaged, self.waiting_since, self.served = True, now, None
            self.lam, self.source = NEVER, Source.FALLBACK
        elif self.drift_cs is None:
            self.engaged, self.drift_since, self.drift_cs = True, now, make_cs()
            self._serve()

    def _window_drift(self, scores: list[np.ndarray]
                      ) -> tuple[DriftMonitor | None, ConformalMartingale | None]:
        """The drift tests against the recalibration window's own scores (docs/AUDIT.md,
        "While drift alarms after a recalibration"): the window test and the sequential one;
        None when no audit of it has a scored step."""
        ref = build_reference(scores, self.drift_k, [self.floor])
        return (None, None) if ref is None else _window_tests(ref)

    def state(self) -> dict[str, Any]:
        """What the journal's snapshot keeps of this guard (its drift tests' observations are
        the process's own and start empty)."""
        r = self.served
        cs: Any = self.cs  # a CensoredAlarm (LiveAudit._snapshot checks that it can be saved)
        dcs: Any = self.drift_cs
        return {"delta": self.delta, "cs": cs.to_dict(), "engaged": self.engaged,
                "waiting_since": self.waiting_since, "recalibrations": self.recalibrations,
                "lam": lam_to_json(self.lam), "source": self.source,
                "drift_since": self.drift_since,
                "drift_cs": None if dcs is None else dcs.to_dict(),
                "served": None if r is None else {
                    "k": r.k, "epsilon": r.epsilon, "lam": lam_to_json(r.lam), "since": r.since,
                    "cs": r.cs.to_dict(),  # type: ignore[attr-defined]
                    "drift": None if r.drift is None else r.drift.reference.model_dump()}}

    def restore(self, d: dict[str, Any]) -> None:
        self.cs = CensoredAlarm.from_dict(d["cs"])
        self.engaged, self.waiting_since = bool(d["engaged"]), d["waiting_since"]
        self.recalibrations = int(d["recalibrations"])
        self.lam, self.source = lam_from_json(d["lam"]), Source(d["source"])
        self.drift_since = d.get("drift_since")
        self.drift_cs = None if d.get("drift_cs") is None else CensoredAlarm.from_dict(
            d["drift_cs"])
        r = d["served"]
        self.served = None if r is None else Recalibrated(
            r["k"], r["epsilon"], lam_from_json(r["lam"]), r["since"],
            CensoredAlarm.from_dict(r["cs"]),
            *((None, None) if r["drift"] is None else _window_tests(
                DriftReference.model_validate(r["drift"]))))
        self.trust()

    def see(self, scores: list[float], lam: float) -> bool:
        """A finished request's scores (one choice): to the served lambda's drift tests.
        Returns whether its sequential test alarmed at this request (the caller journals that:
        `drift_alarm`)."""
        r = self.served
        if r is None:
            return False
        if r.drift is not None:
            r.drift.observe(scores, lam)
            self.trust()
        if r.sequential is None or r.sequential.alarm:
            return False
        r.sequential.observe(scores, lam)
        return r.sequential.alarm

    def trust(self) -> None:
        """Under `recalibrate`: fall back while the recalibrated lambda's drift test alarms at
        its latest test (the traffic is no longer the window's), serve it again when not."""
        drift = None if self.served is None else self.served.drift
        self.distrusted = drift is not None and drift.alarming
        if self.distrusted:
            self.lam, self.source = NEVER, Source.FALLBACK
        elif self.served is not None and self.waiting_since is None:
            self.lam, self.source = self.served.lam, Source.AUDIT

    def row(self) -> dict[str, Any]:
        out = {**_cs_row(self.cs, self.delta), "engaged": self.engaged,
               "lambda": lam_to_json(self.lam), "lambda_source": self.source,
               "bundle_lambda": lam_to_json(self.bundle_lam)}
        if self.drift_cs is not None:  # engaged by the sequential drift test, clearing on these
            out["drift_hold"] = {"since": self.drift_since, "n": int(self.drift_cs.n),
                                 "upper": float(self.drift_cs.upper)}
        if self.on_alarm == OnAlarm.RECALIBRATE:
            out.update(recalibrations=self.recalibrations, waiting_since=self.waiting_since,
                       distrusted=self.distrusted,
                       recalibrated=None if self.served is None else _served_row(self))
        return out


@dataclass
class RecalibratedMu:
    """A mu the give-up guard serves after a recalibration on consistency-labelled audits, and
    the audit of that mu (its own alarm, on the loss it was certified for)."""

    k: int  # the give-up delta's k-th recalibration
    epsilon: float  # LTT's level for it (recalibration_epsilon)
    mu: float  # GIVE_UP_NEVER when LTT certified none
    since: int  # audits admitted after this admission number measure it
    cs: CS


@dataclass
class GiveUpGuard:
    """One give-up delta's audited risk (at the bundle's mu*) and whether its requests give up.

    The bundle's mu* is audited with `request_give_up_loss` with the outcome unknown: live
    audits label by consistency, which cannot tell a right end from a wrong one, so the loss is
    whether the audit would have given up under mu*, at least the certified loss whatever the
    reference labels (docs/AUDIT.md, "The give-up risk"). `fallback` turns give-up off for this
    give-up delta while the guard is engaged: its requests reason on, and no stop threshold
    changes. `recalibrate` does as the stop side's (`DeltaGuard`): on the alarm give-up is off
    until `window` audits admitted after it are labelled, then LTT over mu on those alone at
    `recalibration_epsilon(epsilon, k)` certifies a mu for the give-up loss under consistency
    labels (`orca_method.give_up.changed_by_giving_up`: giving up changed the answer), which
    is served and audited with that loss by its own alarm, whose alarm starts the next wait.
    """

    delta: float
    bundle_mu: float  # GIVE_UP_NEVER = never gives up
    cs: CS
    on_alarm: OnAlarm = OnAlarm.REPORT
    mu: float = GIVE_UP_NEVER  # the mu* requests are served with
    source: Source = Source.BUNDLE  # BUNDLE | FALLBACK (give-up off) | AUDIT (recalibrated)
    engaged: bool = False
    epsilon: float = DEFAULT_EPSILON  # the give-up table's, split across recalibrations
    policy: GiveUpPolicy = GiveUpPolicy.GUESS  # what a given-up request serves (the loss's)
    waiting_since: int | None = None  # recalibrate: the admission number the wait began at
    recalibrations: int = 0
    served: RecalibratedMu | None = None

    def __post_init__(self) -> None:
        self.mu = self.bundle_mu
        self.on_alarm = OnAlarm(self.on_alarm)
        self.policy = GiveUpPolicy(self.policy)

    def observe(self, scores: list[float] | None, seq: int | None = None,
                labels: list[int] | None = None) -> None:
        """One audit's give-up scores (None: censored, its loss unknown) and, for a
        recalibrated mu, its raw consistency labels (None: unknown, censored there); under
        `report` and `fallback` also the decision (`recalibrate` decides in `decide`)."""
        self.cs.update(0.0 if scores is None else request_give_up_loss(
            np.asarray(scores), self.bundle_mu, None), scores is None)
        r = self.served
        if r is not None and seq is not None and seq > r.since:
            known = scores is not None and labels is not None
            r.cs.update(float(request_consistency_give_up_loss(scores, r.mu, labels, self.policy))
                        if known else 0.0, not known)  # type: ignore[arg-type]
        if self.on_alarm == OnAlarm.RECALIBRATE:
            return
        self.engaged = engagement(self.engaged, self.cs, self.delta)
        off = self.engaged and self.on_alarm != OnAlarm.REPORT
        self.mu, self.source = ((GIVE_UP_NEVER, Source.FALLBACK) if off
                                else (self.bundle_mu, Source.BUNDLE))

    def decide(self, now: int, window: Callable[[int], Window | None],
               ltt: Callable[[list[np.ndarray], list[np.ndarray], float, float], float],
               make_cs: Callable[[], CS]) -> None:
        """`recalibrate` (see the class docstring): `now`, audits admitted so far;
        `window(after)`: the first `window` audits admitted after `after` with their give-up
        scores and raw consistency labels, once all are known, else None; `ltt(scores,
        labels, delta, epsilon)`: LTT's mu (`ltt_mu`)."""
        if self.on_alarm != OnAlarm.RECALIBRATE:
            return
        self.source = recalibration(
            self, now, window,
            lambda k, eps, data: RecalibratedMu(k, eps, ltt(data[0], data[1], self.delta, eps),
                                                now, make_cs()))
        self.mu = (GIVE_UP_NEVER if self.source == Source.FALLBACK else self.bundle_mu
                   if self.served is None else self.served.mu)

    def row(self) -> dict[str, Any]:
        out = {**_cs_row(self.cs, self.delta), "engaged": self.engaged,
               "mu": lam_to_json(self.mu), "mu_source": self.source,
               "bundle_mu": lam_to_json(self.bundle_mu)}
        if self.on_alarm == OnAlarm.RECALIBRATE:
            r = self.served
            out.update(recalibrations=self.recalibrations, waiting_since=self.waiting_since,
                       recalibrated=None if r is None else {
                           "k": r.k, "epsilon": r.epsilon, "mu": lam_to_json(r.mu),
                           "since": r.since, **_cs_row(r.cs, self.delta)})
        return out

    def state(self) -> dict[str, Any]:
        cs: Any = self.cs  # a CensoredAlarm (LiveAudit._snapshot checks that it can be saved)
        r = self.served
        return {"delta": self.delta, "cs": cs.to_dict(), "engaged": self.engaged,
                "mu": lam_to_json(self.mu), "source": self.source,
                "waiting_since": self.waiting_since, "recalibrations": self.recalibrations,
                "served": None if r is None else {
                    "k": r.k, "epsilon": r.epsilon, "mu": lam_to_json(r.mu), "since": r.since,
                    "cs": r.cs.to_dict()}}  # type: ignore[attr-defined]

    def restore(self, d: dict[str, Any]) -> None:
        self.cs = CensoredAlarm.from_dict(d["cs"])
        self.engaged, self.source = bool(d["engaged"]), Source(d["source"])
        self.mu = mu_from_json(d["mu"])
        self.waiting_since = d.get("waiting_since")
        self.recalibrations = int(d.get("recalibrations", 0))
        r = d.get("served")
        self.served = None if r is None else RecalibratedMu(
            r["k"], r["epsilon"], mu_from_json(r["mu"]), r["since"],
            CensoredAlarm.from_dict(r["cs"]))


def fed(cs: CS, engaged: bool, delta: float, on_alarm: OnAlarm,
        loss: float | None) -> tuple[bool, bool]:
    """One audit's loss (None: censored, unknown in [0, 1]) into a guard's statistics, and its
    decision under `report` / `fallback` (`recalibrate` acts as `fallback` where the audits
    cannot certify a new threshold): (engaged, whether the guard acts: serves the fallback)."""
    cs.update(0.0 if loss is None else float(loss), loss is None)
    engaged = engagement(engaged, cs, delta)
    return engaged, engaged and on_alarm != OnAlarm.REPORT


@dataclass
class VoteGuard:
    """One consensus row's audited vote error, and whether its groups settle early.

    A row is (per-sample delta, delta_vote) with its certified margin t*. An audited group runs
    every sample to its own (ORCA) end; its loss is 1 when the vote the rule settled at t*
    differs from the vote of all k samples (`orca_serve/live_audit/votes.py`). Acting
    (`fallback`, and `recalibrate`, since no t is recalibrated live) serves the row's groups
    without early settling while the guard is engaged: every sample runs to its ORCA stop and
    the answer is their whole vote (docs/AUDIT.md, "The vote's audit").
    """

    delta: float  # the row's per-sample delta
    delta_vote: float
    t: float  # the row's certified margin t*
    cs: CS
    on_alarm: OnAlarm = OnAlarm.REPORT
    source: Source = Source.BUNDLE  # BUNDLE: t* settles groups; FALLBACK: they wait for all
    engaged: bool = False

    def __post_init__(self) -> None:
        self.on_alarm = OnAlarm(self.on_alarm)

    def observe(self, loss: float | None) -> None:
        """One audited group's vote loss (None: censored: it did not finish), then the
        decision."""
        self.engaged, off = fed(self.cs, self.engaged, self.delta_vote, self.on_alarm, loss)
        self.source = Source.FALLBACK if off else Source.BUNDLE

    def row(self) -> dict[str, Any]:
        return {**_cs_row(self.cs, self.delta_vote), "delta": self.delta,
                "delta_vote": self.delta_vote, "t": self.t, "engaged": self.engaged,
                "t_source": self.source}

    def state(self) -> dict[str, Any]:
        cs: Any = self.cs  # a CensoredAlarm
        return {"delta": self.delta, "delta_vote": self.delta_vote, "cs": cs.to_dict(),
                "engaged": self.engaged, "source": self.source}

    def restore(self, d: dict[str, Any]) -> None:
        self.cs = CensoredAlarm.from_dict(d["cs"])
        self.engaged, self.source = bool(d["engaged"]), Source(d["source"])


def _cs_row(cs: CS, delta: float) -> dict[str, Any]:
    """A guard's statistics as the table shows them (the whole history's, and the alarm's)."""
    n = int(cs.n)
    return {"delta": delta, "n": n, "censored": int(cs.censored), "risk": _finite(cs.mean),
            "risk_range": _range(cs), "lower": float(cs.lower), "upper": float(cs.upper),
            "alarm": bool(n) and bool(cs.alarm(delta)),
            **dict(zip(("alarm_since", "alarm_lower"), cs.alarm_source(delta)))}


def _window_tests(ref: DriftReference) -> tuple[DriftMonitor, ConformalMartingale]:
    """The drift tests of a recalibrated lambda against its window's reference: the window
    test (windows of half the reference's size, tested every quarter) and the sequential one
    (at the sequential test's default level)."""
    size = len(ref.early_mean)
    return (DriftMonitor(ref, window=max(10, size // 2), every=max(5, size // 4), spend=False),
            ConformalMartingale(ref))


def _finite(x: float) -> float | None:
    return None if math.isnan(float(x)) else float(x)


def _range(cs: CS) -> list[float] | None:
    """[risk with the censored audits at loss 0, at loss 1] (None before the first audit)."""
    if not cs.n:
        return None
    rng = getattr(cs, "risk_range", None)
    return [float(cs.mean)] * 2 if rng is None else [float(rng[0]), float(rng[1])]


def _served_row(g: DeltaGuard) -> dict[str, Any]:
    """The audit of the recalibrated lambda a guard serves (its own sequence and alarm)."""
    r = g.served
    assert r is not None
    n = int(r.cs.n)
    return {"k": r.k, "epsilon": r.epsilon, "lambda": lam_to_json(r.lam), "since": r.since, "n": n,
            "censored": int(r.cs.censored), "risk": _finite(r.cs.mean) if n else None,
            "risk_range": _range(r.cs), "lower": float(r.cs.lower),
            "upper": float(r.cs.upper), "alarm": bool(n) and bool(r.cs.alarm(g.delta)),
            "drift": None if r.drift is None else {"pvalue": r.drift.pvalue,
                                                   "alarm": bool(r.drift.alarming),
                                                   "tests": r.drift.tests},
            "sequential": None if r.sequential is None else r.sequential.to_dict()}
