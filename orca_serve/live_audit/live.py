"""The guarantee on live traffic: audit sampling, background labelling, realized risk, the guard.

Learn-then-Test certifies P(risk(lambda*) <= delta) >= 1 - epsilon only while live prompts are
exchangeable with the calibration set. This module measures the realized risk of a running server:

1. **Sampling** (`AuditSampler`): each orca request is picked with probability `rate` by a
   server-side RNG that sees nothing of the request, so the audited requests are a uniform random
   sample of the traffic. A picked request runs with the probe in shadow (the client gets the
   full-budget answer, `"audited": true` in its `orca` object) and in record mode.
2. **Labelling** (`orca_serve.live_audit.labeller`), off the request's path: finished audits wait in a
   bounded queue (full: the audit is dropped and counted, the response never waits) and one
   background task labels them with answer probes through the same engine, exactly as
   `orca-calibrate collect` does (orca_method/answer_probes.py), consistency labels against the
   request's own final answer. Labelled audits are appended to `--orca-audit-dir`
   (`orca_serve.live_audit.store`, the trajectory format).
3. **Realized risk**: for every delta of the bundle's table, an audit's loss is its recorded
   online scores replayed with that delta's bundle lambda* (stop at the first score >= lambda*,
   loss 1 when the labels say the answer there was not yet right), fed to an anytime-valid
   confidence sequence (`orca_serve.live_audit`, `CensoredAlarm`). As in calibration, audits
   whose labels are all 0 (never right) are left out when the bundle excluded them. Audits that
   did not finish (cut by max_tokens, aborted: `orca_serve.live_audit.attrition`) have an
   unknown loss: they enter censored (loss 0 for the alarm, 1 for the upper bound), so the
   bounds hold for the whole traffic; the table shows every share.
4. **The guard** (`DeltaGuard`): alarm for a delta = the lower bound of one of a family of
   confidence sequences restarted every 50 audits and kept at dyadic ages exceeds delta
   (`RestartedAlarm`; the table's risk and bounds are those of the whole history).
   `report` only reports; `fallback` serves that delta with lambda = never (no early stop) until
   the whole history's upper bound is back at delta; `recalibrate` falls back until `window`
   audits admitted after the alarm are labelled, runs LTT (orca_method/ltt.py) once on those at
   a share of epsilon (`recalibration_epsilon`) and serves that lambda, which then has its own
   confidence sequences and alarm (the next alarm: the next recalibration). Audits run in
   shadow, so their scores are complete whatever lambda is served, and each is measured at
   every lambda a guard needs. While a recalibrated lambda's own drift test (against the
   scores of its window) alarms, that delta falls back. `--orca-audit-epsilon-split joint`
   gives each of k deltas' guards epsilon / k.
5. **Drift**: with a drift reference in the bundle, a `DriftMonitor` sees the scores of one
   choice of every finished request (audited or not).
6. **Hot reload** (`hand_over`): a new bundle gets a new LiveAudit; the table, the guards, the
   recalibration window and the drift monitor are that bundle's, because every one of them is
   about one probe and its lambda* (with an audit directory: resumed from the bundle's journal,
   item 7). Audits of requests the old bundle served (waiting for labels, being
   labelled, or still running) are dropped, counted as `superseded` in the new table: their
   losses measure the old lambda*, and the old table is gone.

7. **State** (`attach`, orca_serve/live_audit/journal.py): with an audit directory every
   admission and outcome is journalled per bundle checksum before the guards use it, and the
   guards' state is the fold of the journal (`_apply`): a restart resumes it, and the servers
   of one machine that share the directory share one sequence.

Everything here runs on the server's event loop; nothing blocks a response but the journal's
appends (one line per audit admitted, and one fsynced line per audit resolved).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from orca_method.bundle import Bundle, DriftReference
from orca_method.ltt import calibrate, default_grid
from orca_method.risk import cumulative, is_counted, request_loss
from orca_method.thresholds import NEVER, lam_from_json, lam_to_json
from orca_serve.contract import OrcaResult
from orca_serve.live_audit.attrition import incomplete
from orca_serve.live_audit.drift import DriftMonitor, build_reference, reference_level
from orca_serve.live_audit.journal import SNAPSHOT_EVERY, Journal
from orca_serve.live_audit.labeller import AuditLabeller
from orca_serve.live_audit.options import (
    EPSILON_SPLITS,
    ON_ALARM,
    AuditConfig,
    audit_config,
    audit_journal,
    audit_store,
    guard_epsilon,
    store_info,
)
from orca_serve.live_audit.sequence import CensoredAlarm
from orca_serve.metrics import LABEL
from orca_serve.orca_field import error_body
from orca_serve.requests import OrcaSettings

logger = logging.getLogger("orca_serve.live_audit")

AUDIT_PATH = "/v1/orca/audit"
# What a live audit can label by: agreement with the request's own final answer (live traffic
# has no reference answer for `supervised`, and the server calls no judge).
AUDIT_LABEL_MODE = "consistent"


class AuditSampler:
    """Bernoulli(rate) per request from a private RNG: the decision depends on nothing but the RNG
    (not the prompt, the delta, the time or the load), so audits are a uniform sample."""

    def __init__(self, rate: float, seed: int | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"audit rate must be in [0, 1], got {rate}")
        self.rate = rate
        self._rng = random.Random(seed)

    def pick(self) -> bool:
        return self.rate > 0 and self._rng.random() < self.rate


class CS(Protocol):
    """What the guard needs of its statistics (orca_serve.live_audit.CensoredAlarm): the whole
    history's mean and bounds, the audits counted with an unknown loss, and the alarm."""

    n: int
    censored: int
    mean: float
    lower: float
    upper: float

    def update(self, loss: float, censored: bool = False) -> None: ...

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


def ltt_lambda(scores: list[np.ndarray], labels: list[np.ndarray], delta: float, *,
               epsilon: float, grid_size: int, pvalue: str) -> float:
    """lambda* for `delta` by the calibration code's LTT (orca_method/ltt.py) on these audits."""

    (res,) = calibrate(scores, labels, [delta], epsilon=epsilon, grid=default_grid(grid_size),
                       pvalue=pvalue)
    return res.lam


def recalibration_epsilon(epsilon: float, k: int) -> float:
    """The level of a delta's k-th recalibration (k >= 1): epsilon / (k (k + 1)).

    These sum to epsilon over k, so the probability that ANY recalibration of a delta certifies
    a lambda whose risk exceeds delta stays at most epsilon (union bound), however many alarms a
    deployment sees.
    """
    return epsilon / (k * (k + 1))


Window = tuple[list[np.ndarray], list[np.ndarray]]


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


@dataclass
class DeltaGuard:
    """One delta's realized risk (at the bundle's lambda*) and the lambda it is served with.

    `recalibrate` (docs/AUDIT.md, "Recalibration in the server"): on the bundle's alarm the
    guard falls back (never stops early) until `window` audits ADMITTED AFTER the alarm are
    labelled, runs LTT once on those alone at `recalibration_epsilon(epsilon, k)` and serves
    that lambda (not below `floor`), then audits it with its own alarm; that alarm starts the
    next wait and recalibration. The bundle's lambda* does not return for this bundle (with a
    journal: not after a restart either).
    """

    delta: float
    bundle_lam: float  # inf = never stops early
    cs: CS
    on_alarm: str = "report"
    epsilon: float = 0.05  # the bundle's, split across recalibrations
    floor: float = 0.0  # a recalibrated lambda is served at least this high
    drift_k: int = 10  # the drift statistics' early-mean steps (the bundle's smoothing window)
    lam: float = NEVER
    source: str = "bundle"
    engaged: bool = False  # alarmed and not cleared yet
    waiting_since: int | None = None  # recalibrate: the admission number the wait began at
    recalibrations: int = 0
    served: Recalibrated | None = None
    distrusted: bool = False  # the served lambda's drift test alarms: fallback meanwhile

    def __post_init__(self) -> None:
        self.lam = self.bundle_lam

    @property
    def alarm(self) -> bool:
        """The realized risk of the bundle's lambda* exceeds delta (its lower bound does)."""
        return bool(self.cs.n) and bool(self.cs.alarm(self.delta))

    def observe(self, seq: int, loss: Callable[[float], int] | None) -> None:
        """One counted audit (admission number `seq`): its loss at the bundle's lambda*, and at
        the recalibrated lambda when the audit was admitted after that lambda took effect.
        `loss` None: a censored audit (cut or aborted), whose loss is unknown (CensoredAlarm)."""
        self.cs.update(0.0 if loss is None else loss(self.bundle_lam), loss is None)
        if self.served is not None and seq > self.served.since:
            self.served.cs.update(0.0 if loss is None else loss(self.served.lam), loss is None)

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
        would flap with every loss near the boundary.
        """
        if self.on_alarm == "recalibrate":
            self._recalibrate(now, window, ltt, make_cs)
            return self.trust()
        if self.alarm:
            self.engaged = True
        elif self.engaged and self.cs.upper <= self.delta:
            self.engaged = False
        if self.engaged and self.on_alarm == "fallback":
            self.lam, self.source = NEVER, "fallback"
        else:
            self.lam, self.source = self.bundle_lam, "bundle"

    def _recalibrate(self, now: int, window: Callable[[int], Window | None],
                     ltt: Callable[[list[np.ndarray], list[np.ndarray], float, float], float],
                     make_cs: Callable[[], CS]) -> None:
        served_alarm = self.served is not None and bool(self.served.cs.n) and bool(
            self.served.cs.alarm(self.delta))
        if (not self.engaged and self.alarm) or served_alarm:
            self.engaged, self.waiting_since, self.served = True, now, None
        if self.waiting_since is not None:
            data = window(self.waiting_since)
            if data is None:
                self.lam, self.source = NEVER, "fallback"
                return
            k = self.recalibrations + 1
            eps = recalibration_epsilon(self.epsilon, k)
            lam = max(ltt(data[0], data[1], self.delta, eps), self.floor)
            self.served = Recalibrated(k, eps, lam, now, make_cs(), self._window_drift(data[0]))
            self.recalibrations, self.waiting_since = k, None
        if self.served is not None:
            self.lam, self.source = self.served.lam, "audit"
        else:
            self.lam, self.source = self.bundle_lam, "bundle"

    def _window_drift(self, scores: list[np.ndarray]) -> DriftMonitor | None:
        """A drift test against the recalibration window's own scores (docs/AUDIT.md, "While
        drift alarms after a recalibration"); None when no audit of it has a scored step."""
        ref = build_reference(scores, self.drift_k, [self.floor])
        return None if ref is None else _window_monitor(ref)

    def state(self) -> dict[str, Any]:
        """What the journal's snapshot keeps of this guard (its drift tests' observations are
        the process's own and start empty)."""
        r = self.served
        cs: Any = self.cs  # a CensoredAlarm (LiveAudit._snapshot checks that it can be saved)
        return {"delta": self.delta, "cs": cs.to_dict(), "engaged": self.engaged,
                "waiting_since": self.waiting_since, "recalibrations": self.recalibrations,
                "lam": lam_to_json(self.lam), "source": self.source,
                "served": None if r is None else {
                    "k": r.k, "epsilon": r.epsilon, "lam": lam_to_json(r.lam), "since": r.since,
                    "cs": r.cs.to_dict(),  # type: ignore[attr-defined]
                    "drift": None if r.drift is None else r.drift.reference.model_dump()}}

    def restore(self, d: dict[str, Any]) -> None:
        self.cs = CensoredAlarm.from_dict(d["cs"])
        self.engaged, self.waiting_since = bool(d["engaged"]), d["waiting_since"]
        self.recalibrations = int(d["recalibrations"])
        self.lam, self.source = lam_from_json(d["lam"]), d["source"]
        r = d["served"]
        self.served = None if r is None else Recalibrated(
            r["k"], r["epsilon"], lam_from_json(r["lam"]), r["since"],
            CensoredAlarm.from_dict(r["cs"]),
            None if r["drift"] is None else _window_monitor(DriftReference.model_validate(
                r["drift"])))
        self.trust()

    def see(self, scores: list[float], lam: float) -> None:
        """A finished request's scores (one choice): to the served lambda's drift test."""
        if self.served is not None and self.served.drift is not None:
            self.served.drift.observe(scores, lam)
            self.trust()

    def trust(self) -> None:
        """Under `recalibrate`: fall back while the recalibrated lambda's drift test alarms at
        its latest test (the traffic is no longer the window's), serve it again when not."""
        drift = None if self.served is None else self.served.drift
        self.distrusted = drift is not None and drift.alarming
        if self.distrusted:
            self.lam, self.source = NEVER, "fallback"
        elif self.served is not None and self.waiting_since is None:
            self.lam, self.source = self.served.lam, "audit"

    def row(self) -> dict[str, Any]:
        n = int(self.cs.n)
        out = {"delta": self.delta, "n": n, "censored": int(self.cs.censored),
               "risk": _finite(self.cs.mean), "risk_range": _range(self.cs),
               "lower": float(self.cs.lower), "upper": float(self.cs.upper),
               "alarm": self.alarm, "engaged": self.engaged,
               **dict(zip(("alarm_since", "alarm_lower"), self.cs.alarm_source(self.delta))),
               "lambda": lam_to_json(self.lam), "lambda_source": self.source,
               "bundle_lambda": lam_to_json(self.bundle_lam)}
        if self.on_alarm == "recalibrate":
            out.update(recalibrations=self.recalibrations, waiting_since=self.waiting_since,
                       distrusted=self.distrusted,
                       recalibrated=None if self.served is None else _served_row(self))
        return out


def _window_monitor(ref: DriftReference) -> DriftMonitor:
    """The drift test of a recalibrated lambda: windows of the reference's size (the
    recalibration window's audits), tested every half window."""
    size = len(ref.early_mean)
    return DriftMonitor(ref, window=max(10, size // 2), every=max(5, size // 4), spend=False)


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
                                                   "tests": r.drift.tests}}


def _shown(lam: float) -> str:
    return "never (no early stop)" if math.isinf(lam) else f"{lam:g}"


def log_change(g: DeltaGuard, was_engaged: bool, was_source: str, was_lam: float) -> None:
    """One server-log line per change of a guard: alarm raised or cleared, and the lambda served
    (fallback, recalibrated, the bundle's again)."""
    n, d = int(g.cs.n), f"{g.delta:g}"
    if g.engaged and not was_engaged:
        logger.warning("orca audit: ALARM at delta %s after %d audits: the realized risk of the "
                       "bundle's lambda* %s has lower bound %.3f > delta (on alarm: %s)", d, n,
                       _shown(g.bundle_lam), g.cs.alarm_source(g.delta)[1] or g.cs.lower,
                       g.on_alarm)
    elif was_engaged and not g.engaged:
        logger.info("orca audit: alarm at delta %s cleared after %d audits (upper bound %.3f <= "
                    "delta)", d, n, g.cs.upper)
    if (g.source, g.lam) != (was_source, was_lam):
        how = {"fallback": "fallback", "audit": "recalibrated on the audits after the alarm",
               "bundle": "the bundle's lambda*"}.get(g.source, g.source)
        logger.warning("orca audit: delta %s now served with lambda %s (%s; was %s)", d,
                       _shown(g.lam), how, _shown(was_lam))


def _default_cs_factory(epsilon: float) -> Callable[[], CS]:
    return lambda: CensoredAlarm(epsilon)


def _default_loss(scores: np.ndarray, labels: np.ndarray, lam: float) -> int:
    return request_loss(scores, labels, lam)


@dataclass
class _Job:
    key: str
    rec: dict[str, Any]
    result: OrcaResult  # recorded (record mode)
    seq: int  # admission number (LiveAudit.admitted when it was picked)
    finish_reason: str | None
    lambda_source: str = "bundle"  # the guard's source of the lambda the request was admitted with


class LiveAudit:
    """The server's audit state: sampling, the labelling queue, guards, table and metrics.

    The guards' state is a fold over the ordered audit events (`_apply`): admissions and
    outcomes. With a journal (`attach`) every event goes through it first, so the state
    survives restarts and is shared by the processes that share the journal
    (orca_serve/live_audit/journal.py); without one the events are applied directly.
    """

    def __init__(self, bundle: Bundle, config: AuditConfig, *,
                 cs_factory: Callable[[], CS] | None = None,
                 loss: Callable[[np.ndarray, np.ndarray, float], int] | None = None,
                 drift: Any = None) -> None:
        if config.on_alarm not in ON_ALARM:
            raise ValueError(f"on_alarm must be one of {ON_ALARM}, got {config.on_alarm!r}")
        if config.epsilon_split not in EPSILON_SPLITS:
            raise ValueError(f"epsilon_split must be one of {EPSILON_SPLITS}, "
                             f"got {config.epsilon_split!r}")
        self.bundle = bundle
        self.config = config
        self.sampler = AuditSampler(config.rate, config.seed)
        self.guard_epsilon = guard_epsilon(bundle.ltt.epsilon, len(bundle.deltas()),
                                           config.epsilon_split)
        self.make_cs = cs_factory or _default_cs_factory(self.guard_epsilon)
        self.loss = loss or _default_loss
        # audits measure the risk under consistency labels; a bundle certified under others is
        # only reported on unless the operator lets the guard act (--orca-guard-other-labels)
        self.labels_match = bundle.label_mode == AUDIT_LABEL_MODE
        self.guard_acts = self.labels_match or config.other_labels
        # a recalibrated lambda is served no lower than the bundle's smallest lambda*: the risk
        # only falls as lambda grows, so LTT's certificate carries over, and the drift test's
        # statistics (cut at that level) stay observable on every request
        floor = reference_level([bundle.lam(d) for d in bundle.deltas()])
        self.guards = {d: DeltaGuard(d, bundle.lam(d), self.make_cs(),
                                     config.on_alarm if self.guard_acts else "report",
                                     epsilon=self.guard_epsilon,
                                     floor=0.0 if math.isinf(floor) else floor,
                                     drift_k=bundle.drift.k if bundle.drift else bundle.window)
                       for d in bundle.deltas()}
        if not self.labels_match and config.rate > 0:
            logger.warning("orca audit: the bundle was calibrated with %s labels but live audits "
                           "label by %s, so the audited risk is not the certified one; %s",
                           bundle.label_mode, AUDIT_LABEL_MODE,
                           f"--orca-on-alarm {config.on_alarm} acts on it anyway "
                           "(--orca-guard-other-labels)" if self.guard_acts else
                           "the guard reports only (--orca-guard-other-labels lets it act)")
        self.drift = drift
        self.admitted = 0  # audits admitted so far; each audit's admission number is its seq
        # what became of each audit admitted after the oldest pending wait of a guard: its
        # (scores, labels) when it entered the risk, None when it did not (see _resolve)
        self._resolved: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}
        self._open: dict[int, str | None] = {}  # admitted, not resolved yet: seq -> owner
        self.replayed = 0  # events read back from the journal when it was attached
        self._unsaved = 0  # events applied since the last snapshot
        self.counts = {"picked": 0, "labelled": 0, "dropped": 0, "failed": 0, "aborted": 0,
                       "length": 0, "unsolvable": 0, "unaligned": 0, "superseded": 0,
                       "lost": 0}
        self.labeller: Any = None  # AuditLabeller, made on first use (needs the engine client)
        self.store: Any = None  # AuditStore when a directory is configured
        self.journal: Journal | None = None  # the events on disk, when a directory is configured
        self.collector: AuditCollector | None = None  # its metrics, when registered
        self.retired = False  # replaced by a hot reload: takes nothing in any more
        self._pending: dict[str, tuple[dict[str, Any], int]] = {}
        self._queue: asyncio.Queue[_Job] | None = None
        self._worker: asyncio.Task | None = None
        self.engine_client: Callable[[], Any] = lambda: None

    def guard(self, delta: float) -> DeltaGuard:
        """The guard of a delta of the table (resolve() accepted only those)."""
        for d, g in self.guards.items():
            if math.isclose(d, delta, rel_tol=0, abs_tol=1e-9):
                return g
        raise KeyError(f"delta {delta} is not in the bundle's table")

    # -- the events (the only way the guards' state changes) ----------------------------------
    def attach(self, journal: Journal) -> None:
        """Take the journal of this bundle: replay what it holds (earlier processes, or others
        running now), then journal every event; audits a dead process left open are lost."""
        self.journal = journal
        state = journal.read_snapshot()
        if state is not None and state.get("settings") == self._settings():
            self._restore(state)
        else:
            state = None
            journal.rewind()
        events = journal.read()
        for e in events:
            self._apply(e, quiet=True)
        self.replayed = len(events)
        if events or state is not None:
            rows = ", ".join(f"delta {g.delta:g}: {g.cs.n} audits, lambda {_shown(g.lam)} "
                             f"({g.source})" for g in self.guards.values())
            logger.info("orca audit: resumed %s from %s (%s%d events replayed)", rows,
                        journal.path, "a snapshot and " if state is not None else "",
                        len(events))
        if len(events) >= SNAPSHOT_EVERY:
            self._snapshot()
        self.reap()

    def _settings(self) -> dict[str, Any]:
        """What the fold depends on besides the events: a snapshot folded under other settings
        is not used (the journal is replayed under the current ones instead)."""
        return {"on_alarm": [g.on_alarm for g in self.guards.values()],
                "window": self.config.window, "guard_epsilon": self.guard_epsilon}

    def _snapshot(self) -> None:
        """Write the folded state (journal.py, "Snapshots"); skipped for statistics that cannot
        be saved (tests' fakes)."""
        assert self.journal is not None
        self._unsaved = 0
        if not all(hasattr(g.cs, "to_dict") for g in self.guards.values()):
            return
        self.journal.write_snapshot({
            "settings": self._settings(), "admitted": self.admitted,
            "open": [[seq, owner] for seq, owner in self._open.items()],
            "resolved": [[seq, None if v is None else [v[0].tolist(), v[1].tolist()]]
                         for seq, v in self._resolved.items()],
            "lost": self.counts["lost"], "guards": [g.state() for g in self.guards.values()]})

    def _restore(self, state: dict[str, Any]) -> None:
        self.admitted = int(state["admitted"])
        self._open = {int(seq): owner for seq, owner in state["open"]}
        self._resolved = {int(seq): None if v is None else
                          (np.asarray(v[0], dtype=float), np.asarray(v[1], dtype=np.int8))
                          for seq, v in state["resolved"]}
        self.counts["lost"] = int(state["lost"])
        for g, d in zip(self.guards.values(), state["guards"]):
            g.restore(d)

    def _event(self, event: dict[str, Any]) -> None:
        """Journal one event (first applying what other processes journalled before it), or
        apply it directly without a journal. Outcomes are fsynced, admissions not."""
        if self.journal is None:
            return self._apply(event)
        events = self.journal.append(event, durable="a" not in event)
        for e in events:
            self._apply(e)
        self._count_unsaved(len(events))

    def _count_unsaved(self, n: int) -> None:
        self._unsaved += n
        if self._unsaved >= SNAPSHOT_EVERY:
            self._snapshot()

    def sync(self) -> None:
        """Apply what other processes journalled since (cheap when nothing was: one fstat);
        while a guard waits for a window, also reap the audits of processes that are gone."""
        if self.journal is None:
            return
        events = self.journal.read()
        for e in events:
            self._apply(e)
        self._count_unsaved(len(events))
        if any(g.waiting_since is not None for g in self.guards.values()):
            self.reap()

    def reap(self) -> None:
        """Journal as `lost` the open audits of processes that are gone (their admissions would
        keep a recalibration window waiting for ever)."""
        if self.journal is None:
            return
        owners = {owner for owner in self._open.values() if owner is not None}
        dead = {owner for owner in owners if not self.journal.alive(owner)}
        for seq, owner in list(self._open.items()):
            if owner in dead:
                self._event({"r": seq, "o": "lost"})

    def _apply(self, e: dict[str, Any], quiet: bool = False) -> None:
        """Fold one event into the guards (identically in every process that reads it)."""
        if "a" in e:
            self.admitted += 1
            self._open[self.admitted] = e["a"]
            return
        seq, outcome = int(e["r"]), e["o"]
        if seq not in self._open:
            return  # resolved twice (two processes reaped it at once): the first counts
        del self._open[seq]
        if outcome == "lost":
            self.counts["lost"] += 1
        item = None
        if "s" in e:
            item = (np.asarray(e["s"], dtype=float), np.asarray(e["l"], dtype=np.int8))
        if outcome == "risk":
            assert item is not None
            s, labels = item
            for g in self.guards.values():
                g.observe(seq, lambda lam: self.loss(s, labels, lam))
        elif outcome == "censored":
            for g in self.guards.values():
                g.observe(seq, None)
        self._resolve(seq, item if outcome in ("risk", "censored") else None, quiet)

    # -- the request path (cheap, synchronous; orca_serve.requests.Thresholds) ----------------
    def lam(self, delta: float) -> tuple[float, str]:
        """(lambda*, source) an enabled request with `delta` runs with: its guard's, after what
        other processes journalled. BundleError for a delta outside the bundle's table."""
        self.bundle.lam(delta)  # the bundle's refusal, as without an audit
        self.sync()
        g = self.guard(delta)
        return g.lam, g.source

    def admit(self, settings: OrcaSettings, body: dict[str, Any]) -> OrcaSettings:
        """The settings an enabled request runs with (right after `lam`): audited or not. The
        draw is made for every enabled request and uses nothing but the sampler's RNG."""
        if not self.sampler.pick():
            return settings
        self.counts["picked"] += 1
        self._pending[settings.key] = ({k: body[k] for k in ("messages", "prompt") if k in body},
                                       self._admit())
        return replace(settings, audited=True)

    def _admit(self) -> int:
        """Admit one audit; its admission number (global across the journal's processes)."""
        self._event({"a": None if self.journal is None else self.journal.owner})
        # the newest admission of this owner: ours (one process admits one at a time)
        return self.admitted

    def finished(self, settings: OrcaSettings, results: dict[int, OrcaResult | None],
                 finish_reasons: dict[int, str | None]) -> None:
        """A request ended (its results fetched; `finish_reasons` per choice, as the response
        gave them, a choice missing when it never finished): feed drift, queue its audit."""
        if self.retired:
            return
        first = results.get(0)
        if first and first.scores and not first.error:
            # one choice per request: the choices of one prompt share its difficulty, so n of
            # them are not n independent draws the test could count. Shadow runs (audits)
            # never stop: their scores are complete.
            lam = first.lam if first.policy.rule.acts and first.lam is not None else NEVER
            self.see(list(first.scores), lam)
        pending = self._pending.pop(settings.key, None)
        if pending is None:
            return
        rec, seq = pending
        why = ("the engine reported no result" if not first else
               f"the engine reported an error: {first.error}" if first.error else
               "the result has no recording" if not first.recorded else
               "no reasoning step to label" if not first.step_tokens else None)
        reason = finish_reasons.get(0)
        cut = incomplete(reason)
        if cut is not None:  # cut or aborted: its loss is unknown, it enters as censored
            self.counts[cut] += 1
            if why is not None:  # nothing to label: censored without a record
                return self._event({"r": seq, "o": "censored"})
        elif why is not None:
            self.counts["failed"] += 1
            logger.warning("orca audit %s failed: %s", settings.key, why)
            return self._event({"r": seq, "o": "out"})
        self._submit(_Job(settings.key, rec, first, seq, reason, settings.lam_source))

    def see(self, scores: list[float], lam: float) -> None:
        """One finished request's scores (choice 0): to the bundle's drift test and to the
        drift tests of the recalibrated lambdas served."""
        if self.drift is not None:
            self.drift.observe(scores, lam)
        for g in self.guards.values():
            before = (g.engaged, g.source, g.lam)
            g.see(scores, lam)
            log_change(g, *before)

    def _submit(self, job: _Job) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue(maxsize=self.config.queue)
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self.counts["dropped"] += 1
            return self._event({"r": job.seq, "o": "out"})
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._work())

    # -- background --------------------------------------------------------------------------
    async def _work(self) -> None:
        assert self._queue is not None
        while not self._queue.empty():
            job = self._queue.get_nowait()
            try:
                await self._process(job)
            except Exception as e:  # noqa: BLE001 - one bad audit must not stop the others
                if not self.retired:
                    self.counts["failed"] += 1
                    self._event({"r": job.seq, "o": "out"})
                logger.warning("orca audit %s failed: %r", job.key, e)

    async def _process(self, job: _Job) -> None:
        if self.labeller is None:
            self.labeller = AuditLabeller(self.engine_client(), self.config.probe)
        record = await self.labeller.label(job.key, job.rec, job.result, job.finish_reason)
        # unrounded: replaying them must reproduce the server's stop decisions, also at lambda 1.0
        # (LTT's grid top, what recalibration picks when only saturated scores are safe), which
        # 6-decimal rounding crossed by turning 0.9999998 into 1.0
        record["extra"]["audit"] = {"scores": [float(s) for s in job.result.scores],
                                    "delta": job.result.delta,
                                    "lambda": lam_to_json(job.result.lam),
                                    "lambda_source": job.lambda_source, "seq": job.seq}
        if self.retired:  # replaced while it was being labelled (counted by the successor)
            return
        # the outcome first (the statistics), then the record: a crash between the two loses
        # the record's embeddings, never the audit's place in the risk
        self.observe(list(job.result.scores), record["labels"][AUDIT_LABEL_MODE], job.seq,
                     censored=incomplete(job.finish_reason) is not None)
        if self.store is not None:
            await asyncio.to_thread(self.store.append, record, job.result.step_embeddings)

    def observe(self, scores: list[float], raw_labels: list[int], seq: int | None = None, *,
                censored: bool = False) -> None:
        """One labelled audit: losses at every lambda a guard measures, then every guard decides.

        `seq`: its admission number; None for an audit fed directly (tests, simulations),
        admitted and labelled at once. `censored`: it was cut by max_tokens or aborted, so
        its loss is unknown (it enters both ends of the bounds, CensoredAlarm); its labels
        (up to the cut, as calibration labels a cut trajectory) still go to a recalibration
        window.
        """
        if seq is None:
            seq = self._admit()
        if not censored:
            self.counts["labelled"] += 1
        labels = cumulative(np.asarray(raw_labels))
        s = None
        if not is_counted(labels, self.bundle.ltt.excluded_never_correct):
            if not censored:
                self.counts["unsolvable"] += 1
        else:
            s = aligned_scores(scores, len(labels))
            if s is None:
                self.counts["unaligned"] += 1
                logger.warning("orca audit: %d scores for %d steps; left out", len(scores),
                               len(labels))
        event: dict[str, Any] = {"r": seq, "o": "censored" if censored else
                                 "risk" if s is not None else "out"}
        if s is not None:
            event.update(s=s.tolist(), l=labels.tolist())
        self._event(event)

    def _resolve(self, seq: int, item: tuple[np.ndarray, np.ndarray] | None,
                 quiet: bool = False) -> None:
        """An audit's outcome is known: keep it while a guard waits for audits admitted after
        its alarm, then let every guard decide. An audit left out (failed, dropped, never
        right, unaligned, lost) resolves as None: the window skips it but waits for it, so the
        window is the first audits by admission, not the first to finish (short ones)."""
        waits = [g.waiting_since for g in self.guards.values() if g.waiting_since is not None]
        if waits and seq > min(waits):
            self._resolved[seq] = item
        for g in self.guards.values():
            before = (g.engaged, g.source, g.lam)
            g.decide(self.admitted, self._window, self._ltt, self.make_cs)
            if not quiet:
                log_change(g, *before)
        waits = [g.waiting_since for g in self.guards.values() if g.waiting_since is not None]
        oldest = min(waits, default=self.admitted)
        for old in [q for q in self._resolved if q <= oldest]:
            del self._resolved[old]

    def _window(self, after: int) -> Window | None:
        """The first `config.window` counted audits admitted after `after`, by admission
        number, once every audit admitted between them is resolved; else None."""
        scores, labels = [], []
        seq = after + 1
        while len(scores) < self.config.window:
            if seq not in self._resolved:
                return None
            item = self._resolved[seq]
            if item is not None:
                scores.append(item[0])
                labels.append(item[1])
            seq += 1
        return scores, labels

    def _ltt(self, scores: list[np.ndarray], labels: list[np.ndarray], delta: float,
             epsilon: float) -> float:
        t = self.bundle.ltt
        return ltt_lambda(scores, labels, delta, epsilon=epsilon, grid_size=t.grid_size,
                          pvalue=t.pvalue)

    # -- hot reload ----------------------------------------------------------------------------
    def hand_over(self, successor: LiveAudit) -> None:
        """A new bundle's audit takes over (see the module docstring, item 6): this one's
        unfinished audits are dropped and counted as `superseded` there, its metrics collector
        reads the successor from now on, and the successor writes to this audit's store when
        the two bundles' audit records agree (same model and pooling), else opens its own."""

        self.retired = True
        queued = 0
        while self._queue is not None and not self._queue.empty():
            self._queue.get_nowait()
            queued += 1
        successor.counts["superseded"] += len(self._pending) + queued + (
            1 if self._worker is not None and not self._worker.done() else 0)
        self._pending.clear()
        if self.collector is not None:
            self.collector.audit = successor
            successor.collector, self.collector = self.collector, None
        if successor.config.directory is not None and successor.store is None:
            if self.store is not None and self.store.info == store_info(successor.bundle):
                successor.store = self.store
            else:
                if self.store is not None:
                    self.store.close()
                successor.store = audit_store(successor.config, successor.bundle)
        self.store = None
        if self.journal is not None:  # closed first: the successor may open the same file
            self.journal.close()
            self.journal = None
        if successor.config.directory is not None and successor.journal is None:
            successor.attach(audit_journal(successor.config, successor.bundle))
        successor.engine_client = self.engine_client

    # -- reading -----------------------------------------------------------------------------
    def attrition(self) -> dict[str, float | None]:
        """Shares of the picked audits that did not enter the risk with a known loss, by cause:
        bias diagnostics.

        A uniform sample stays uniform only if what is lost is lost at random; a cause whose
        share is not small (failing, unaligned) can depend on the request, and then the risk
        measured on the rest is not the traffic's. Cut and aborted audits (`length`,
        `aborted`) are in the risk as censored (CensoredAlarm): their share is what widens
        the bounds."""
        picked = self.counts["picked"]
        return {k: (self.counts[k] / picked if picked else None)
                for k in ("dropped", "failed", "aborted", "length", "unaligned", "unsolvable")}

    def table(self) -> dict[str, Any]:
        """GET /v1/orca/audit."""
        self.sync()
        c = self.config
        out: dict[str, Any] = {
            "bundle_checksum": self.bundle.checksum,
            "rate": c.rate, "on_alarm": c.on_alarm, "label_mode": AUDIT_LABEL_MODE,
            "bundle_label_mode": self.bundle.label_mode, "labels_match": self.labels_match,
            "guard_acts": self.guard_acts,
            "epsilon": self.bundle.ltt.epsilon,
            "epsilon_split": c.epsilon_split, "guard_epsilon": self.guard_epsilon,
            "recalibrate_window": c.window if c.on_alarm == "recalibrate" else None,
            "directory": None if self.store is None else str(self.store.root),
            "journal": None if self.journal is None else str(self.journal.path),
            "admitted": self.admitted, "open": len(self._open), "replayed": self.replayed,
            "queued": 0 if self._queue is None else self._queue.qsize(),
            **self.counts,
            "attrition": self.attrition(),
            "deltas": [g.row() for g in self.guards.values()],
        }
        if self.drift is not None:
            out["drift"] = {"pvalue": self.drift.pvalue, "alarm": bool(self.drift.alarm)}
        return out


def add_audit_route(app: Any, get_audit: Callable[[], LiveAudit | None]) -> None:
    """GET /v1/orca/audit: the table (404 on a server without a bundle)."""
    # deferred: fastapi (offline tools import this module)
    from fastapi.responses import JSONResponse

    # No return annotation: under `from __future__ import annotations` FastAPI cannot resolve
    # the string "JSONResponse" when it builds /openapi.json (HTTP 500).
    async def orca_audit():
        audit = get_audit()
        if audit is None:
            return JSONResponse(error_body(
                "this server runs without a calibration bundle (start orca-serve with --calib)",
                code=404, err_type="NotFoundError"), status_code=404)
        return JSONResponse(audit.table())

    app.add_api_route(AUDIT_PATH, orca_audit, methods=["GET"], name="orca_audit",
                      response_model=None)


class AuditCollector(Collector):
    """The audit's Prometheus metrics, read from the live state at each scrape."""

    def __init__(self, audit: LiveAudit, model_name: str = "") -> None:
        self.audit = audit
        self.model_name = model_name  # vLLM's `model_name` label, as on every orca metric

    def collect(self) -> Iterable[Any]:
        a, m = self.audit, self.model_name
        c = CounterMetricFamily("orca_audit_requests", "Audited requests by state: labelled "
                                "(entered the risk), dropped (labelling queue full), failed, "
                                "aborted (never finished), length (cut by max_tokens)",
                                labels=[LABEL, "state"])
        for state in ("labelled", "dropped", "failed", "aborted", "length"):
            c.add_metric([m, state], a.counts[state])
        yield c
        fams = {
            "risk": GaugeMetricFamily("orca_audit_risk", "Realized risk of the bundle's lambda* "
                                      "on the audited requests (mean loss)", labels=[LABEL, "delta"]),
            "lower": GaugeMetricFamily("orca_audit_risk_lower", "Anytime-valid lower confidence "
                                       "bound of the realized risk", labels=[LABEL, "delta"]),
            "upper": GaugeMetricFamily("orca_audit_risk_upper", "Anytime-valid upper confidence "
                                       "bound of the realized risk", labels=[LABEL, "delta"]),
            "alarm": GaugeMetricFamily("orca_audit_alarm", "1 when the lower bound exceeds delta",
                                       labels=[LABEL, "delta"]),
            "censored": GaugeMetricFamily("orca_audit_censored", "Audits in the risk with an "
                                          "unknown loss (cut by max_tokens or aborted): loss 0 "
                                          "for the lower bound, 1 for the upper",
                                          labels=[LABEL, "delta"]),
        }
        lam = GaugeMetricFamily("orca_audit_lambda", "lambda served for this delta (+Inf: never "
                                "stops early) and where it comes from", labels=[LABEL, "delta", "source"])
        for g in a.guards.values():
            row, d = g.row(), f"{g.delta:g}"
            fams["risk"].add_metric([m, d], row["risk"] if row["risk"] is not None else math.nan)
            fams["lower"].add_metric([m, d], row["lower"])
            fams["upper"].add_metric([m, d], row["upper"])
            fams["alarm"].add_metric([m, d], float(row["alarm"]))
            fams["censored"].add_metric([m, d], float(row["censored"]))
            lam.add_metric([m, d, g.source], g.lam)
        yield from fams.values()
        yield lam
        lm = GaugeMetricFamily("orca_audit_labels_match", "1 when the audits label as the bundle "
                               "was calibrated (else the audited risk is not the certified one, "
                               "and the guard only reports unless --orca-guard-other-labels)",
                               labels=[LABEL, "bundle_label_mode", "audit_label_mode"])
        lm.add_metric([m, a.bundle.label_mode, AUDIT_LABEL_MODE], float(a.labels_match))
        yield lm
        if a.drift is not None and a.drift.pvalue is not None:  # absent before the first test
            p = GaugeMetricFamily("orca_drift_pvalue", "p-value of the latest score-drift test "
                                  "against the bundle's reference", labels=[LABEL])
            p.add_metric([m], a.drift.pvalue)
            yield p
        if a.drift is not None:
            al = GaugeMetricFamily("orca_drift_alarm", "1 when the score-drift test alarms",
                                   labels=[LABEL])
            al.add_metric([m], float(bool(a.drift.alarm)))
            yield al


def make_live_audit(ns: argparse.Namespace, bundle: Any, registry: Any,
                    model_name: str = "", *, store: bool = True) -> Any:
    """The server's LiveAudit (metrics registered on `registry` with vLLM's `model_name`
    label), its store when a dir is set. `store=False`: without one (a hot reload opens it, or
    takes the old audit's, when it takes over: `LiveAudit.hand_over`)."""
    config = audit_config(ns)
    live = LiveAudit(bundle, config, drift=DriftMonitor.from_bundle(bundle))
    if store and config.directory is not None:
        live.store = audit_store(config, bundle)
        live.attach(audit_journal(config, bundle))
    if registry is not None:
        live.collector = AuditCollector(live, model_name)
        registry.register(live.collector)
    return live
