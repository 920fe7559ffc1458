"""The guarantee on live traffic: the server's live audit, from a request's admission to its labels.

Learn-then-Test certifies P(risk(lambda*) <= delta) >= 1 - epsilon only while live prompts are
exchangeable with the calibration set; the live audit measures the realized risk of a running
server (statistics: docs/AUDIT.md; operations: docs/AUDIT-OPERATIONS.md). `LiveAudit` is:

1. **Sampling** (`orca_serve.live_audit.sampling`): a uniform random sample of the orca requests
   runs with the probe in shadow (the client gets the full-budget answer, `"audited": true`)
   and in record mode. `admit` also serves every request the lambda (and mu*) its guards decide.
2. **Labelling** (`orca_serve.live_audit.labeller`), off the request's path: finished audits
   wait in a bounded queue (full: the audit is dropped and counted, the response never waits)
   and one background task labels them with answer probes through the same engine, exactly as
   `orca-calibrate collect` does, consistency labels against the request's own final answer.
   Labelled audits are appended to `--orca-audit-dir` (`orca_serve.live_audit.store`).
3. **The guards' state** (`state`, an `orca_serve.live_audit.state.AuditState`: the fold of
   the journalled audit events, which a `LiveAudit` holds and changes through its face): per
   delta the realized risk of the bundle's lambda* and the lambda served, per
   give-up delta the audited give-up risk and whether requests give up; the decisions are the
   method's (`orca_method.audit.guards`). Give-up is decided by the give-up guard (`mu`). A
   two-sided bundle's audits are scored by its give-up probe here (`_give_up_scores`), since
   audits never give up.
4. **Drift**: with a drift reference in the bundle, a `DriftMonitor` (window test) and a
   `ConformalMartingale` (sequential test; reported, and answered by the guards as their own
   alarm only with `--orca-audit-drift-acts`) see the scores of one choice of every finished
   request (audited or not).
5. **The vote** (`votes`, an `orca_serve.live_audit.votes.VoteAudit`, the state's): a share of
   the voted groups (`orca.samples`) run to their end, their vote error against its own bound,
   journalled as the other audit events.
6. **Hot reload** (`orca_serve.live_audit.handover`: builds the successor), the table
   (`GET /v1/orca/audit`: `orca_serve.live_audit.route`) and the metrics
   (`orca_serve.live_audit.collector`).

A `LiveAudit` is given everything it works with when it is built (its journal, store, drift
monitor, labeller and the engine client's getter; `orca_serve.live_audit.factory`), and nothing
outside it assigns into it.

Everything here runs on the server's event loop; nothing blocks a response but the journal's
appends (one line per audit admitted, and one fsynced line per audit resolved).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import numpy as np

from orca_method.audit.attrition import Cause, incomplete
from orca_method.audit.drift import DriftMonitor
from orca_method.audit.guards import CS, aligned_scores
from orca_method.audit.martingale import ConformalMartingale
from orca_method.bundle import Bundle
from orca_method.outcomes import GiveUpLoss, LabelSteps, OnAlarm, Source
from orca_method.probe import Probe
from orca_method.procedure import replay
from orca_method.risk import cumulative, is_counted
from orca_method.thresholds import NEVER, lam_to_json
from orca_serve.settings.contract import OrcaResult, OrcaSettings, VoteSettings
from orca_serve.live_audit.fleet import store_state
from orca_serve.live_audit.guard_log import log_change
from orca_serve.live_audit.journal import AuditOutcome, EventJournal
from orca_serve.live_audit.labeller import AUDIT_LABEL_MODE, AuditLabeller, Labeller
from orca_serve.live_audit.options import AuditConfig
from orca_serve.live_audit.sampling import AuditSampler
from orca_serve.live_audit.state import AuditState
from orca_serve.live_audit.store import AuditStore

logger = logging.getLogger("orca_serve.live_audit")


@dataclass
class _Job:
    key: str
    rec: dict[str, Any]
    result: OrcaResult  # recorded (record mode)
    seq: int  # admission number (AuditState.admitted when it was picked)
    finish_reason: str | None
    lambda_source: Source = Source.BUNDLE  # the guard's source of the admitted lambda


class AuditCount(StrEnum):
    """The request-path counts of a live audit (the table's keys and the metrics' states)."""

    PICKED = "picked"  # sampled for an audit
    LABELLED = "labelled"  # labelled to its end: in the risk
    DROPPED = "dropped"  # the labelling queue was full
    FAILED = "failed"  # the engine reported no result, an error, or no recording
    ABORTED = Cause.ABORTED.value  # never finished: in the risk, censored
    LENGTH = Cause.CUT.value  # cut by max_tokens: in the risk, censored
    UNSOLVABLE = "unsolvable"  # never right: outside the certified risk
    UNALIGNED = "unaligned"  # its scores did not match its steps
    NO_STEPS = "no_steps"  # no reasoning step to label
    SUPERSEDED = "superseded"  # unfinished when a hot reload retired its audit


# the counts of picked audits that did not enter the risk whole (`LiveAudit.attrition`)
ATTRITION = (AuditCount.DROPPED, AuditCount.FAILED, AuditCount.ABORTED, AuditCount.LENGTH,
             AuditCount.UNALIGNED, AuditCount.UNSOLVABLE, AuditCount.NO_STEPS)


class LiveAudit:
    """The server's live audit (see the module docstring). Its face: the request path (`lam`,
    `mu`, `admit`, `finished`), audits fed directly (`observe`, `see`), hot reload (`retire`)
    and reading (`table`, `attrition`, `counts`, `state`: the guards)."""

    def __init__(self, bundle: Bundle, config: AuditConfig, *,
                 journal: EventJournal | None = None, store: AuditStore | None = None,
                 drift: DriftMonitor | None = None,
                 sequential: ConformalMartingale | None = None,
                 engine_client: Callable[[], Any] | None = None,
                 labeller: Labeller | None = None,
                 cs_factory: Callable[[], CS] | None = None,
                 loss: Callable[[np.ndarray, np.ndarray, float], int] | None = None) -> None:
        """`journal`: the bundle's event journal (replayed now; None: the events are not
        kept); `store`: where labelled audits are appended (None: nowhere); `drift`: the
        bundle's drift test; `sequential`: its sequential drift test; `engine_client`: returns the server's engine client (vLLM makes
        it after the app), which labels the audits; `labeller`: labels them instead (tests);
        `cs_factory`, `loss`: the guards' statistics and loss (tests, simulations)."""
        self.bundle = bundle
        self.config = config
        self.state = AuditState(bundle, config, journal=journal, cs_factory=cs_factory,
                                loss=loss)
        self.votes = self.state.votes
        self.store = store
        self.drift = drift
        self.sequential = sequential
        self.engine_client = engine_client or (lambda: None)
        self.sampler = AuditSampler(config.rate, config.seed)
        self.counts = dict.fromkeys(AuditCount, 0)
        self.retired = False  # replaced by a hot reload: takes nothing in any more
        self._labeller = labeller  # made on first use (needs the engine client), unless given
        self._give_up_probe: Probe | None = None  # the bundle's give-up probe, on first use
        self._pending: dict[str, tuple[dict[str, Any], int]] = {}
        self._queue: asyncio.Queue[_Job] | None = None
        self._worker: asyncio.Task | None = None

    # -- the request path (cheap, synchronous; orca_serve.settings.resolve.Thresholds) ----------------
    def lam(self, delta: float) -> tuple[float, Source]:
        """(lambda*, source) an enabled request with `delta` runs with: its guard's, after what
        other processes journalled. BundleError for a delta outside the bundle's table."""
        self.bundle.lam(delta)  # the bundle's refusal, as without an audit
        self.state.sync()
        g = self.state.guard(delta)
        return g.lam, g.source

    def mu(self, give_up_delta: float) -> tuple[float, Source]:
        """(mu*, source) a request giving up at `give_up_delta` runs with (right after `lam`,
        which read what other processes journalled): the give-up guard's, GIVE_UP_NEVER with
        source `fallback` after its alarm (give-up off: the request reasons on). BundleError
        for a delta outside the bundle's give-up table."""
        mu = self.bundle.mu(give_up_delta)  # the bundle's refusal, as without an audit
        if not self.state.give_up_guards:
            return mu, Source.BUNDLE
        gu = self.state.give_up_guard(give_up_delta)
        return gu.mu, gu.source

    def admit(self, settings: OrcaSettings, body: dict[str, Any]) -> OrcaSettings:
        """The settings an enabled request runs with (right after `lam` and `mu`), audited or
        not. The draw is made for every enabled request and uses nothing but the sampler's
        RNG."""
        if not self.sampler.pick():
            return settings
        self.counts[AuditCount.PICKED] += 1
        self._pending[settings.key] = ({k: body[k] for k in ("messages", "prompt") if k in body},
                                       self.state.admit())
        return replace(settings, audited=True)

    def finished(self, settings: OrcaSettings, results: dict[int, OrcaResult | None],
                 finish_reasons: dict[int, str | None]) -> None:
        """A request ended (its results fetched; `finish_reasons` per choice, as the response
        gave them, a choice missing when it never finished): feed drift, queue its audit."""
        if self.retired or settings.group_known:
            # a request in a group the bundle knows ran on its group's table, not the one the
            # audit and the drift test watch (docs/METHOD.md section 12)
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
               "the result has no recording" if not first.recorded else None)
        # no reasoning step (thinking off, a zero thinking budget): nothing ORCA could stop, and
        # no step a label could call right; calibration has no such trace either
        no_steps = why is None and not first.step_tokens
        reason = finish_reasons.get(0)
        cut = incomplete(reason)
        if cut is not None:  # cut or aborted: its loss is unknown, it enters as censored
            self.counts[AuditCount(cut)] += 1
            if why is not None or no_steps:  # nothing to label: censored without a record
                return self.state.outcome(seq, AuditOutcome.CENSORED, cause=cut)
        elif no_steps:
            self.counts[AuditCount.NO_STEPS] += 1
            return self.state.outcome(seq, AuditOutcome.OUT)
        elif why is not None:
            self.counts[AuditCount.FAILED] += 1
            logger.warning("orca audit %s failed: %s", settings.key, why)
            return self.state.outcome(seq, AuditOutcome.OUT)
        self._submit(_Job(settings.key, rec, first, seq, reason, settings.lam_source))

    def vote_finished(self, vote: VoteSettings, delta: float, loss: float | None, *,
                      refused: bool = False) -> None:
        """An audited voted group ended (`loss`: its vote error, None when unknown; `refused`:
        vLLM refused it, nothing ran): journalled to the vote's guard, unless a hot reload
        replaced this audit meanwhile (its successor's guards are another bundle's, or the same
        one's read back from the journal)."""
        event = None if self.retired else self.votes.event(vote, delta, loss, refused=refused)
        if event is not None:
            self.state.vote(event)

    def see(self, scores: list[float], lam: float) -> None:
        """One finished request's scores (choice 0): to the bundle's drift tests (the window
        test and the sequential one) and to the drift tests of the recalibrated lambdas
        served. A sequential test's alarm is journalled (`AuditState.drift_alarm`): a
        recalibrated lambda's guard recalibrates anew; the guards answer the bundle's as their
        alarm only with `config.drift_acts`, since it says the scores changed, not that the
        risk grew (greedy clients of a bundle calibrated on sampled traces set it off), so by
        default it is reported only."""
        if self.drift is not None:
            self.drift.observe(scores, lam)
        seq = self.sequential
        if seq is not None and not seq.alarm and seq.observe(scores, lam) and seq.alarm:
            acts = self.config.drift_acts
            logger.warning("orca audit: DRIFT ALARM after %d requests: the sequential drift "
                           "test's capital reached %.3g >= 1/alpha (alpha %g): the live scores "
                           "no longer look like the calibration split's; %s",
                           seq.observed, seq.capital, seq.alpha,
                           f"on alarm: {self.config.on_alarm}" if acts else
                           "reported only (--orca-audit-drift-acts lets the guards answer it)")
            self.state.drift_alarm()  # journalled either way; folded only with drift_acts
        for g in self.state.guards.values():
            before = (g.engaged, g.source, g.lam)
            k = None if g.served is None else g.served.k
            if g.see(scores, lam):
                logger.warning("orca audit: DRIFT ALARM at delta %g: the traffic is no longer "
                               "the window recalibration %d was certified on", g.delta, k)
                self.state.drift_alarm(g.delta, k)
            log_change(g, *before)

    def _submit(self, job: _Job) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue(maxsize=self.config.queue)
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self.counts[AuditCount.DROPPED] += 1
            return self.state.outcome(job.seq, AuditOutcome.OUT)
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
                    self.counts[AuditCount.FAILED] += 1
                    self.state.outcome(job.seq, AuditOutcome.OUT)
                logger.warning("orca audit %s failed: %r", job.key, e)

    async def _process(self, job: _Job) -> None:
        if self._labeller is None:
            self._labeller = AuditLabeller(self.engine_client(), self.config.probe)
        give_up = self._give_up_scores(job.result.step_embeddings)
        self.state.sync()  # what other processes decided before this audit was admitted
        needs = (self.state.label_needs(job.seq) if self.config.label_steps == LabelSteps.SELECTIVE
                 else None)
        record = await self._labeller.label(job.key, job.rec, job.result, job.finish_reason,
                                            needs, give_up)
        # unrounded: replaying them must reproduce the server's stop decisions, also at lambda 1.0
        # (LTT's grid top, what recalibration picks when only saturated scores are safe), which
        # 6-decimal rounding crossed by turning 0.9999998 into 1.0
        # bundle_checksum: the audit is this bundle's (its journal's), as audit-report counts it
        record["extra"]["audit"] = {"bundle_checksum": self.bundle.checksum,
                                    "scores": [float(s) for s in job.result.scores],
                                    "delta": job.result.delta,
                                    "lambda": lam_to_json(job.result.lam),
                                    "lambda_source": job.lambda_source, "seq": job.seq}
        if self.retired:  # replaced while it was being labelled (counted by the successor)
            return
        # the outcome first (the statistics), then the record: a crash between the two loses
        # the record's embeddings, never the audit's place in the risk
        cause = incomplete(job.finish_reason)
        self.observe(list(job.result.scores), record["labels"][AUDIT_LABEL_MODE], job.seq,
                     censored=cause is not None, cause=cause, give_up=give_up)
        if self.store is not None:
            await self._record(job, record)

    async def _record(self, job: _Job, record: dict[str, Any]) -> None:
        """Write a labelled audit's record to the directory. Its outcome is journalled already,
        so a failure here (a full disk) costs the record only: it is logged, and neither counted
        as `failed` (attrition: an audit that did not enter the risk) nor given a second
        outcome, which the table would show as an audit both labelled and failed."""
        assert self.store is not None
        try:
            await asyncio.to_thread(self.store.append, record, job.result.step_embeddings)
        except Exception as e:  # noqa: BLE001 - the audit itself is in the risk already
            logger.warning("orca audit %s: its record could not be written (%r); the audit is "
                           "in the risk all the same, its record is missing from %s", job.key,
                           e, self.config.directory)

    def _give_up_scores(self, embeddings: np.ndarray | None) -> list[float] | None:
        """The give-up probe's smoothed scores of an audit's recorded steps, by the replay that
        calibration scores them with (None for a one-sided bundle). Audits never give up, so
        the engine computes none of them; the probe is static, so replay gives what it would."""
        gu = self.bundle.give_up
        if gu is None:
            return None
        if self._give_up_probe is None:
            self._give_up_probe = self.bundle.load_give_up_probe()
        ((_, smoothed),) = replay(self._give_up_probe, [embeddings], window=gu.window)
        return [float(x) for x in smoothed]

    def observe(self, scores: list[float], raw_labels: list[int], seq: int | None = None, *,
                censored: bool = False, cause: str | None = None,
                give_up: list[float] | None = None) -> None:
        """One labelled audit: losses at every lambda a guard measures, then every guard decides.

        `seq`: its admission number; None for an audit fed directly (tests, simulations),
        admitted and labelled at once. `censored`: it was cut by max_tokens or aborted, so
        its loss is unknown at the lambdas that would stop after where it ended (it enters
        both ends of the bounds there, `cut_feed`; `cause`: why, the attrition count); its
        labels (up to the cut, as calibration labels a cut trajectory) still go to a
        recalibration window. `give_up`: its give-up scores, one per step (a two-sided bundle); the give-up
        risk is over every audit, never-right ones too, as calibration's is.
        """
        if seq is None:
            seq = self.state.admit()
        if not censored:
            self.counts[AuditCount.LABELLED] += 1
        labels = cumulative(np.asarray(raw_labels))
        s = None
        if not is_counted(labels, self.bundle.ltt.excluded_never_correct):
            if not censored:
                self.counts[AuditCount.UNSOLVABLE] += 1
        else:
            s = aligned_scores(scores, len(labels))
            if s is None:
                self.counts[AuditCount.UNALIGNED] += 1
                logger.warning("orca audit: %d scores for %d steps; left out", len(scores),
                               len(labels))
        self.state.outcome(
            seq, AuditOutcome.CENSORED if censored else AuditOutcome.RISK if s is not None
            else AuditOutcome.OUT,
            cause=cause if censored else None,
            scores=None if s is None else s.tolist(), labels=None if s is None else labels.tolist(),
            give_up=[float(x) for x in give_up]
            if give_up is not None and len(give_up) == len(labels) else None,
            raw=[int(x) for x in raw_labels] if self.state.give_up_guards else None)

    def retire(self) -> tuple[int, AuditStore | None]:
        """Take nothing in any more (a hot reload replaced this audit), drop the audits waiting
        for labels and close the journal (the successor may open the same file). Returns how
        many were unfinished (admitted and still running, queued, or being labelled: the one
        being labelled is not recorded when it ends) and the store, which is the caller's now
        (`orca_serve.live_audit.handover`)."""
        self.retired = True
        queued = 0
        while self._queue is not None and not self._queue.empty():
            self._queue.get_nowait()
            queued += 1
        unfinished = len(self._pending) + queued + int(self.labelling)
        self._pending.clear()
        self.close()
        store, self.store = self.store, None
        return unfinished, store

    def adopt(self, superseded: int, store: AuditStore | None) -> None:
        """What a hot reload hands this audit as it takes over from a retired one
        (`orca_serve.live_audit.handover.take_over`): that one's unfinished audits, counted as
        `superseded`, and the store to write to (None: its audits are not stored)."""
        self.counts[AuditCount.SUPERSEDED] = superseded
        self.store = store

    def close(self) -> None:
        """Leave the journal (a reload's `retire`, or the server stopping): on a fleet's store
        this process's owner key goes at once, so the other replicas reap what it left open
        and, once it was the last, replicas with other guard flags may join; left to expire,
        the key counted this process as running for its TTL (15 s) after it stopped."""
        self.state.close()

    # -- reading -----------------------------------------------------------------------------
    @property
    def labelling(self) -> bool:
        """An audit is being labelled or its record written (the outcome comes first, the
        record after it: until this is False, the directory may lack the last one)."""
        return self._worker is not None and not self._worker.done()

    def attrition(self) -> dict[str, float | None]:
        """Shares of the picked audits that did not enter the risk with a known loss, by cause:
        bias diagnostics.

        A uniform sample stays uniform only if what is lost is lost at random; a cause whose
        share is not small (failing, unaligned) can depend on the request, and then the risk
        measured on the rest is not the traffic's. Cut and aborted audits (`length`,
        `aborted`) are in the risk as censored (CensoredAlarm): their share is what widens
        the bounds."""
        picked = self.counts[AuditCount.PICKED]
        return {k: (self.counts[k] / picked if picked else None)
                for k in ATTRITION}

    def table(self) -> dict[str, Any]:
        """GET /v1/orca/audit."""
        st = self.state
        st.sync()
        c = self.config
        out: dict[str, Any] = {
            "bundle_checksum": self.bundle.checksum,
            "rate": c.rate, "on_alarm": c.on_alarm, "label_mode": AUDIT_LABEL_MODE,
            "bundle_label_mode": self.bundle.label_mode, "labels_match": st.labels_match,
            "guard_acts": st.guard_acts,
            "epsilon": self.bundle.ltt.epsilon,
            "epsilon_split": c.epsilon_split, "guard_epsilon": st.guard_epsilon,
            "recalibrate_window": c.window if c.on_alarm == OnAlarm.RECALIBRATE else None,
            "directory": None if self.store is None else str(self.store.root),
            "journal": None if st.journal is None else str(st.journal.path),
            "store": store_state(st.journal),
            "admitted": st.admitted, "open": st.unresolved, "replayed": st.replayed,
            "journal_skipped": 0 if st.journal is None else st.journal.skipped,
            "queued": 0 if self._queue is None else self._queue.qsize(),
            "labelling": int(self.labelling),
            **self.counts, "lost": st.lost,
            "attrition": self.attrition(),
            "deltas": [g.row() for g in st.guards.values()],
            "give_up": None if not st.give_up_guards else {
                "label_mode": self.bundle.give_up.label_mode,  # type: ignore[union-attr]
                "loss": GiveUpLoss.GAVE_UP, "recalibrated_loss": GiveUpLoss.CHANGED,
                "guard_acts": st.give_up_acts,
                "epsilon": self.bundle.give_up.ltt.epsilon,  # type: ignore[union-attr]
                "guard_epsilon": st.give_up_epsilon,
                "deltas": [g.row() for g in st.give_up_guards.values()]},
        }
        if self.votes.guards:
            out["vote"] = self.votes.table()
        if self.drift is not None:
            out["drift"] = {"pvalue": self.drift.pvalue, "alarm": bool(self.drift.alarm)}
        if self.sequential is not None:
            out["sequential_drift"] = {**self.sequential.to_dict(),
                                       "acts": self.config.drift_acts}
        return out
