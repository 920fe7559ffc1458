"""The live audit's state: the guards, as a fold of the ordered audit events.

Every admission (an audit picked) and every outcome (its scores and labels when it entered the
risk, `censored` when it was cut or aborted, left out otherwise; a two-sided bundle's outcomes
also carry the audit's give-up scores) is an event, and the guards' state is the fold of the
events in order (`_apply`). With an audit directory every event is journalled per bundle
checksum before the guards use it (the journal it is built with,
orca_serve/live_audit/journal.py): a restart
resumes the state, and the servers of one machine that share the directory share one sequence
(a fleet's replicas: through `--orca-audit-store`, orca_serve/live_audit/fleet.py).
The guards' decisions are the method's (`orca_method.audit.guards`); the request path, the
labelling queue and hot reload are `orca_serve.live_audit.live`, whose `LiveAudit` holds one
`AuditState` and changes it only through its face: `admit`, `outcome`, `sync`, `close`.
Statistics: docs/AUDIT.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from orca_method.audit.drift import reference_level
from orca_method.audit.guards import (
    CS,
    DeltaGuard,
    GiveUpGuard,
    Window,
    cut_feed,
    ltt_lambda,
    ltt_mu,
)
from orca_method.audit.sequence import CensoredAlarm
from orca_method.bundle import Bundle
from orca_method.outcomes import ON_ALARM, OnAlarm
from orca_method.risk import request_loss
from orca_serve.live_audit.guard_log import log_change, log_give_up_change, shown_lam
from orca_serve.live_audit.journal import (
    DRIFT,
    SNAPSHOT_EVERY,
    AuditOutcome,
    EventJournal,
    is_drift,
    is_vote,
)
from orca_serve.live_audit.labeller import AUDIT_LABEL_MODE
from orca_serve.live_audit.options import (
    EPSILON_SPLITS,
    FOLD_FORMAT,
    AuditConfig,
    fold_flags,
    guard_epsilon,
)
from orca_serve.live_audit.votes import VoteAudit

logger = logging.getLogger("orca_serve.live_audit")


# the owner of an admission whose journal line was corrupt and skipped (journal.py, "Corrupt
# lines"), known only from a later outcome's number: reaped as lost unless its outcome comes
_SKIPPED = "?skipped"
CENSORING = "stop-before-end"  # the fold's rule for unfinished audits (_settings)
# seconds between two looks (`sync`) for the open audits of processes that are gone, while no
# guard waits for a window: one store call per owner then, not one per request
REAP_EVERY = 5.0


def _lookup(guards: dict[float, Any], delta: float, what: str) -> Any:
    for d, g in guards.items():
        if math.isclose(d, delta, rel_tol=0, abs_tol=1e-9):
            return g
    raise KeyError(f"{what} {delta} is not in the bundle's table")


def _first_resolved(resolved: dict[int, tuple[np.ndarray, np.ndarray] | None], after: int,
                    size: int) -> Window | None:
    """The first `size` items of `resolved` (admission number -> item, None: skipped) admitted
    after `after`, in admission order, once every audit admitted between them is resolved;
    else None (the window is the first audits by admission, not the first to finish)."""
    scores, labels = [], []
    seq = after + 1
    while len(scores) < size:
        if seq not in resolved:
            return None
        item = resolved[seq]
        if item is not None:
            scores.append(item[0])
            labels.append(item[1])
        seq += 1
    return scores, labels


def _default_cs_factory(epsilon: float) -> Callable[[], CS]:
    return lambda: CensoredAlarm(epsilon)


def _default_loss(scores: np.ndarray, labels: np.ndarray, lam: float) -> int:
    return request_loss(scores, labels, lam)


class AuditState:
    """The guards of one bundle and the events they are folded from (see the module docstring):
    with a journal every event goes through it first; without one the events are applied
    directly."""

    def __init__(self, bundle: Bundle, config: AuditConfig, *,
                 journal: EventJournal | None = None,
                 cs_factory: Callable[[], CS] | None = None,
                 loss: Callable[[np.ndarray, np.ndarray, float], int] | None = None) -> None:
        if config.on_alarm not in ON_ALARM:
            raise ValueError(f"on_alarm must be one of {ON_ALARM}, got {config.on_alarm!r}")
        if config.epsilon_split not in EPSILON_SPLITS:
            raise ValueError(f"epsilon_split must be one of {EPSILON_SPLITS}, "
                             f"got {config.epsilon_split!r}")
        self.bundle = bundle
        self.config = config
        self.votes = VoteAudit(bundle, config)  # the vote's guards: folded from the events too
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
                                     config.on_alarm if self.guard_acts else OnAlarm.REPORT,
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
        # the give-up guards (a two-sided bundle): live audits cannot label by the give-up's
        # reference labels, so falling back on their alarm needs the operator's leave (as
        # above); `recalibrate` serves a mu certified on the audits' own labels (consistency:
        # docs/METHOD.md section 9), so it acts without it
        gu = bundle.give_up
        self.give_up_epsilon = None if gu is None else guard_epsilon(
            gu.ltt.epsilon, len(gu.ltt.rows), config.epsilon_split)
        self.give_up_acts = config.other_labels or config.on_alarm == OnAlarm.RECALIBRATE
        self.make_gu_cs = cs_factory or _default_cs_factory(self.give_up_epsilon or 0.0)
        on_alarm = config.on_alarm if self.give_up_acts else OnAlarm.REPORT
        self.give_up_guards = {d: GiveUpGuard(d, bundle.mu(d), self.make_gu_cs(), on_alarm,
                                              epsilon=self.give_up_epsilon or 0.0,
                                              policy=gu.policy)  # type: ignore[union-attr]
                               for d in bundle.give_up_deltas()}
        # what became of each audit admitted after the oldest wait of a give-up guard: its
        # give-up scores and raw consistency labels, None when it has not both
        self._give_up_resolved: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}
        self.admitted = 0  # audits admitted so far; each audit's admission number is its seq
        # what became of each audit admitted after the oldest pending wait of a guard: its
        # (scores, labels) when it entered the risk, None when it did not (see _resolve)
        self._resolved: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}
        self._open: dict[int, str | None] = {}  # admitted, not resolved yet: seq -> owner
        self.replayed = 0  # events read back from the journal when it was attached
        self._unsaved = 0  # events applied since the last snapshot
        self.lost = 0  # audits journalled as lost (their process died before their outcome)
        self._reaped_at = time.monotonic()  # when `reap` last looked (`_reap_due`)
        self.journal: EventJournal | None = None  # the events, on disk or the fleet's store
        if journal is not None:
            self._attach(journal)

    @property
    def unresolved(self) -> int:
        """Audits admitted whose outcome is not known yet (the table's `open`)."""
        return len(self._open)

    def guard(self, delta: float) -> DeltaGuard:
        """The guard of a delta of the table (resolve() accepted only those)."""
        return _lookup(self.guards, delta, "delta")

    def give_up_guard(self, delta: float) -> GiveUpGuard:
        """The guard of a give-up delta of the bundle's give-up table."""
        return _lookup(self.give_up_guards, delta, "give-up delta")

    # -- the events (the only way the guards' state changes) ----------------------------------
    def _attach(self, journal: EventJournal) -> None:
        """Take the journal of this bundle (at construction): join the processes that fold it
        now, under the same flags and fold format (`fold_flags`, `FOLD_FORMAT`; other ones, or
        a fold record that cannot be read: `FoldSettingsDiffer`; the journal is closed on any
        failure to join), replay what it holds (earlier processes, or others running now), then
        journal every event; audits a dead process left open are lost."""
        try:
            journal.join(fold_flags(self.config), FOLD_FORMAT)
        except BaseException:
            journal.close()
            raise
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
            rows = ", ".join(f"delta {g.delta:g}: {g.cs.n} audits, lambda {shown_lam(g.lam)} "
                             f"({g.source})" for g in self.guards.values())
            logger.info("orca audit: resumed %s from %s (%s%d events replayed)", rows,
                        journal.path, "a snapshot and " if state is not None else "",
                        len(events))
        if len(events) >= SNAPSHOT_EVERY:
            self._snapshot()
        self.reap()

    def _settings(self) -> dict[str, Any]:
        """What the fold depends on besides the events: a snapshot folded under other settings
        is not used (the journal is replayed under the current ones instead). A one-sided
        bundle's settings are what they were before the give-up guards existed, so its
        snapshots stay usable. Derived from the flags that processes folding the journal at
        once must share (`fold_flags`, checked when attaching)."""
        out: dict[str, Any] = {"on_alarm": [g.on_alarm for g in self.guards.values()],
                               "window": self.config.window, "guard_epsilon": self.guard_epsilon,
                               # how a censored audit is folded (guards.cut_feed): snapshots
                               # folded before it counted every one censored at every lambda
                               "censoring": CENSORING}
        if self.config.drift_acts:  # the bundle's drift alarms are folded (absent: skipped)
            out["drift_acts"] = True
        if self.give_up_guards:
            out["give_up"] = {"on_alarm": [g.on_alarm for g in self.give_up_guards.values()],
                              "guard_epsilon": self.give_up_epsilon}
            if any(g.on_alarm == OnAlarm.RECALIBRATE for g in self.give_up_guards.values()):
                # snapshots folded before give-up recalibration fell back instead
                out["give_up"]["recalibrates"] = "consistency"
        if self.votes.guards:  # absent without a consensus block: its snapshots stay usable
            out["votes"] = self.votes.settings()
        if FOLD_FORMAT > 1:  # absent at format 1: the snapshots of before it stay usable
            out["fold_format"] = FOLD_FORMAT
        return out

    def _snapshot(self) -> None:
        """Write the folded state (journal.py, "Snapshots"); skipped for statistics that cannot
        be saved (tests' fakes)."""
        assert self.journal is not None
        self._unsaved = 0
        if not all(hasattr(g.cs, "to_dict") for g in [*self.guards.values(),
                                                          *self.give_up_guards.values()]):
            return
        votes = {"votes": self.votes.state()} if self.votes.guards else {}
        self.journal.write_snapshot({**votes,
            "give_up": [g.state() for g in self.give_up_guards.values()],
            "settings": self._settings(), "admitted": self.admitted,
            "open": [[seq, owner] for seq, owner in self._open.items()],
            "resolved": [[seq, None if v is None else [v[0].tolist(), v[1].tolist()]]
                         for seq, v in self._resolved.items()],
            "give_up_resolved": [[seq, None if v is None else [v[0].tolist(), v[1].tolist()]]
                                 for seq, v in self._give_up_resolved.items()],
            "lost": self.lost, "guards": [g.state() for g in self.guards.values()]})

    def _restore(self, state: dict[str, Any]) -> None:
        self.admitted = int(state["admitted"])
        self._open = {int(seq): owner for seq, owner in state["open"]}
        self._resolved = {int(seq): None if v is None else
                          (np.asarray(v[0], dtype=float), np.asarray(v[1], dtype=np.int8))
                          for seq, v in state["resolved"]}
        self._give_up_resolved = {int(seq): None if v is None else
                                  (np.asarray(v[0], dtype=float), np.asarray(v[1], dtype=np.int8))
                                  for seq, v in state.get("give_up_resolved", [])}
        self.lost = int(state["lost"])
        for g, d in zip(self.guards.values(), state["guards"]):
            g.restore(d)
        for gu, d in zip(self.give_up_guards.values(), state.get("give_up", [])):
            gu.restore(d)
        if "votes" in state:  # folded under the same vote settings (`_settings`)
            self.votes.restore(state["votes"])

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
        and reap the audits of processes that are gone when it is due (`_reap_due`)."""
        if self.journal is None:
            return
        events = self.journal.read()
        for e in events:
            self._apply(e)
        self._count_unsaved(len(events))
        if self._reap_due():
            self.reap()

    def _reap_due(self) -> bool:
        """Whether `sync` reaps: always while a guard waits for a window (a dead process's
        admission must not hold it up), else every `REAP_EVERY` seconds, so that the table's
        `open` and `lost` show a replica that died, or the others' audits open when this one
        lost the store, without a store call per owner on every request."""
        waiting = any(g.waiting_since is not None for g in [*self.guards.values(),
                                                            *self.give_up_guards.values()])
        return waiting or time.monotonic() - self._reaped_at >= REAP_EVERY

    def reap(self) -> None:
        """Journal as `lost` the open audits of processes that are gone (their admissions would
        keep a recalibration window waiting for ever, and `open` above 0)."""
        if self.journal is None:
            return
        self._reaped_at = time.monotonic()
        owners = {owner for owner in self._open.values() if owner not in (None, _SKIPPED)}
        dead = {owner for owner in owners if not self.journal.alive(owner)} | {_SKIPPED}
        for seq, owner in list(self._open.items()):
            if owner in dead:
                self._event({"r": seq, "o": AuditOutcome.LOST})

    def _apply(self, e: dict[str, Any], quiet: bool = False) -> None:
        """Fold one event into the guards (identically in every process that reads it)."""
        if "a" in e:
            self.admitted += 1
            self._open[self.admitted] = e["a"]
            return
        if is_vote(e):  # an audited voted group's loss (`vote`)
            return self.votes.apply(e, quiet)
        if is_drift(e):  # a sequential drift test alarmed (drift_alarm)
            if e.get("d") is None and not self.config.drift_acts:
                return  # the bundle's: reported only without --orca-audit-drift-acts
            for g in self.guards.values():
                if e.get("d") is None or math.isclose(g.delta, e["d"], abs_tol=1e-9):
                    before = (g.engaged, g.source, g.lam)
                    g.drift_alarm(self.admitted, e.get("k"), self.make_cs)
                    if not quiet:
                        log_change(g, *before)
            return
        seq, outcome = int(e["r"]), e["o"]  # a word: members compare equal to it
        if seq > self.admitted:  # admissions up to it were corrupt lines, skipped (journal.py)
            self._open.update(dict.fromkeys(range(self.admitted + 1, seq + 1), _SKIPPED))
            self.admitted = seq
        if seq not in self._open:
            return  # resolved twice (two processes reaped it at once): the first counts
        del self._open[seq]
        if outcome == AuditOutcome.LOST:
            self.lost += 1
        item = None
        if "s" in e:
            item = (np.asarray(e["s"], dtype=float), np.asarray(e["l"], dtype=np.int8))
        if outcome == AuditOutcome.RISK:
            assert item is not None
            s, labels = item
            for g in self.guards.values():
                g.observe(seq, lambda lam: (float(self.loss(s, labels, lam)), False, 1.0))
        elif outcome == AuditOutcome.CENSORED:
            # with its recording, known at the thresholds that stop before its end (cut_feed);
            # "c": why it did not finish (journals before it: unknown, treated as aborted)
            feed = None if item is None else (
                lambda lam: cut_feed(item[0], item[1], lam, e.get("c"), self.loss))
            for g in self.guards.values():
                g.observe(seq, feed)
        if "g" in e:  # in the give-up risk (journals written before it have no "g": left out)
            self._give_up(seq, None if outcome == AuditOutcome.CENSORED else e["g"], e.get("y"),
                          quiet)
        counted = outcome in (AuditOutcome.RISK, AuditOutcome.CENSORED)
        self._resolve(seq, item if counted else None, quiet)
        self._give_up_resolve(seq, e.get("g"), e.get("y"), quiet)

    def _give_up(self, seq: int, scores: list[float] | None, labels: list[int] | None,
                 quiet: bool) -> None:
        """One audit's give-up scores (None: censored) and raw consistency labels (None:
        unknown) to every give-up guard."""
        for g in self.give_up_guards.values():
            before = (g.engaged, g.source)
            g.observe(scores, seq, labels)
            if not quiet:
                log_give_up_change(g, *before)

    def _give_up_resolve(self, seq: int, scores: list[float] | None, labels: list[int] | None,
                         quiet: bool) -> None:
        """`_resolve` of the give-up side (`recalibrate`): keep the audit's give-up scores and
        raw consistency labels while a give-up guard waits (a cut audit's up to its cut, as
        calibration keeps cut traces; None without both: the window skips it), then let
        every give-up guard decide."""
        if not any(g.on_alarm == OnAlarm.RECALIBRATE for g in self.give_up_guards.values()):
            return
        waits = [g.waiting_since for g in self.give_up_guards.values()
                 if g.waiting_since is not None]
        if waits and seq > min(waits):
            self._give_up_resolved[seq] = None if scores is None or labels is None else (
                np.asarray(scores, dtype=float), np.asarray(labels, dtype=np.int8))
        for g in self.give_up_guards.values():
            before = (g.engaged, g.source)
            g.decide(self.admitted, self._give_up_window, self._mu_ltt, self.make_gu_cs)
            if not quiet:
                log_give_up_change(g, *before)
        waits = [g.waiting_since for g in self.give_up_guards.values()
                 if g.waiting_since is not None]
        oldest = min(waits, default=self.admitted)
        for old in [q for q in self._give_up_resolved if q <= oldest]:
            del self._give_up_resolved[old]

    def label_needs(self, seq: int) -> tuple[list[float], list[float]] | None:
        """The thresholds whose losses the guards will read of audit `seq` (selective audit
        labelling, orca_method/audit/labelling.py): every delta's bundle lambda*, and the
        recalibrated lambda its guard serves when the audit was admitted after it took
        effect; the recalibrated mu of a give-up guard likewise (the bundle's mu* is audited
        by its scores alone). None: label every step, since a guard waits for a recalibration
        window the audit may enter.

        Exact at any later fold: a decision that makes an audit measure a new threshold (a
        recalibrated lambda, or a wait whose window takes it) is taken at an admission number
        below the audit's only if it was folded before the audit's admission, so it is in
        this state already; one folded later has a number at or above it and never reads it.
        """
        lams: set[float] = set()
        for g in self.guards.values():
            if g.waiting_since is not None and seq > g.waiting_since:
                return None
            lams.add(g.bundle_lam)
            if g.served is not None and seq > g.served.since:
                lams.add(g.served.lam)
        mus: set[float] = set()
        for gu in self.give_up_guards.values():
            if gu.waiting_since is not None and seq > gu.waiting_since:
                return None
            if gu.served is not None and seq > gu.served.since:
                mus.add(gu.served.mu)
        return sorted(lams), sorted(mus)

    def drift_alarm(self, delta: float | None = None, k: int | None = None) -> None:
        """A sequential drift test alarmed in this process: the bundle's (`delta` None), or
        that of `delta`'s k-th recalibrated lambda. Journalled, so that every process (and a
        replay) responds at the same place in the sequence (DeltaGuard.drift_alarm); the
        bundle's is folded only with `config.drift_acts` (else reported only)."""
        self._event({"x": DRIFT, "d": delta, "k": k})

    def vote(self, event: dict[str, Any]) -> None:
        """An audited voted group's loss (`journal.vote_event`): journalled
        as every audit event, so its row's sequence is the fleet's and survives a restart."""
        self._event(event)

    def admit(self) -> int:
        """Admit one audit; its admission number (global across the journal's processes)."""
        self._event({"a": None if self.journal is None else self.journal.owner})
        # the newest admission of this owner: ours (one process admits one at a time)
        return self.admitted

    def outcome(self, seq: int, outcome: AuditOutcome, *, scores: list[float] | None = None,
                labels: list[int] | None = None, give_up: list[float] | None = None,
                cause: str | None = None, raw: list[int] | None = None) -> None:
        """The outcome of admission `seq`: `risk` (with its `scores` and cumulative `labels`),
        `censored` (cut or aborted: its loss is unknown past where it ended; with its labels up
        to there, if any, and "c", its `cause`: the attrition count) or `out` (left out of the
        risk). A two-sided bundle's event also carries "g", its give-up scores when given
        (`give_up`; a censored audit's are in the give-up risk censored, and in a give-up
        recalibration window with its labels up to the cut), null when censored without them,
        and "y", the raw consistency labels (`raw`) a recalibrated mu's loss reads; an event
        without "g" is not in the give-up risk."""
        event: dict[str, Any] = {"r": seq, "o": outcome}
        if scores is not None:
            event.update(s=scores, l=labels)
        if cause is not None:
            event["c"] = cause
        if self.give_up_guards and (outcome == AuditOutcome.CENSORED or give_up is not None):
            event["g"] = give_up
            if raw is not None:
                event["y"] = raw
        self._event(event)

    def close(self) -> None:
        """Close the journal (a hot reload's successor may open the same file); no event is
        journalled from here on."""
        if self.journal is not None:
            self.journal.close()
            self.journal = None

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
        return _first_resolved(self._resolved, after, self.config.window)

    def _give_up_window(self, after: int) -> Window | None:
        """The first `config.window` audits admitted after `after` that carry give-up scores
        and raw consistency labels (the give-up risk is over every request: never-right ones
        too), once every audit admitted between them is resolved; else None."""
        return _first_resolved(self._give_up_resolved, after, self.config.window)

    def _mu_ltt(self, scores: list[np.ndarray], labels: list[np.ndarray], delta: float,
                epsilon: float) -> float:
        gu = self.bundle.give_up
        assert gu is not None
        return ltt_mu(scores, labels, delta, epsilon=epsilon, grid_size=gu.ltt.grid_size,
                      pvalue=gu.ltt.pvalue, policy=gu.policy)

    def _ltt(self, scores: list[np.ndarray], labels: list[np.ndarray], delta: float,
             epsilon: float) -> float:
        t = self.bundle.ltt
        return ltt_lambda(scores, labels, delta, epsilon=epsilon, grid_size=t.grid_size,
                          pvalue=t.pvalue)
