"""The live audit's Prometheus metrics (`orca_audit_*`, `orca_drift_*`), read at each scrape
from whichever audit serves then (a hot reload swaps it: `orca_serve.live_audit.handover`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from orca_method.outcomes import Source
from orca_serve.live_audit.fleet import store_metrics
from orca_serve.live_audit.labeller import AUDIT_LABEL_MODE
from orca_serve.live_audit.live import AuditCount, LiveAudit
from orca_serve.live_audit.state import AuditState
from orca_serve.live_audit.votes import VoteAudit, VoteCount
from orca_serve.metrics.prometheus import LABEL

# orca_audit_requests' states (its help names them): those a picked audit ends in
METRIC_STATES = (AuditCount.LABELLED, AuditCount.DROPPED, AuditCount.FAILED, AuditCount.ABORTED,
                 AuditCount.LENGTH, AuditCount.NO_STEPS)


class AuditCollector(Collector):
    """The audit's Prometheus metrics, read from the live state at each scrape: `audit`
    returns the audit that serves (None: no metrics)."""

    def __init__(self, audit: Callable[[], LiveAudit | None], model_name: str = "") -> None:
        self._audit = audit
        self.model_name = model_name  # vLLM's `model_name` label, as on every orca metric

    def collect(self) -> Iterable[Any]:
        a, m = self._audit(), self.model_name
        if a is None:
            return
        st = a.state
        c = CounterMetricFamily("orca_audit_requests", "Audited requests by state: labelled "
                                "(entered the risk), dropped (labelling queue full), failed, "
                                "aborted (never finished), length (cut by max_tokens), no_steps "
                                "(no reasoning step to label)",
                                labels=[LABEL, "state"])
        for state in METRIC_STATES:
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
                                          "unknown loss at lambda* (cut by max_tokens or "
                                          "aborted before its stop): loss 0 for the lower "
                                          "bound; for the upper, the loss at the cut (1 if "
                                          "aborted)",
                                          labels=[LABEL, "delta"]),
        }
        lam = GaugeMetricFamily("orca_audit_lambda", "lambda served for this delta (+Inf: never "
                                "stops early) and where it comes from", labels=[LABEL, "delta", "source"])
        for g in st.guards.values():
            row, d = g.row(), f"{g.delta:g}"
            fams["risk"].add_metric([m, d], row["risk"] if row["risk"] is not None else math.nan)
            fams["lower"].add_metric([m, d], row["lower"])
            fams["upper"].add_metric([m, d], row["upper"])
            fams["alarm"].add_metric([m, d], float(row["alarm"]))
            fams["censored"].add_metric([m, d], float(row["censored"]))
            lam.add_metric([m, d, g.source], g.lam)
        yield from fams.values()
        yield lam
        yield from store_metrics(st.journal, m)
        if st.give_up_guards:
            yield from _give_up_families(st, m)
        if a.votes.guards:
            yield from _vote_families(a.votes, m)
        lm = GaugeMetricFamily("orca_audit_labels_match", "1 when the audits label as the bundle "
                               "was calibrated (else the audited risk is not the certified one, "
                               "and the guard only reports unless --orca-guard-other-labels)",
                               labels=[LABEL, "bundle_label_mode", "audit_label_mode"])
        lm.add_metric([m, a.bundle.label_mode, AUDIT_LABEL_MODE], float(st.labels_match))
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
        if a.sequential is not None:
            cap = GaugeMetricFamily("orca_drift_sequential_capital", "Capital of the sequential "
                                    "drift test (a test martingale against the bundle's "
                                    "reference: 1 at the start, the alarm at 1/alpha)",
                                    labels=[LABEL])
            cap.add_metric([m], a.sequential.capital)
            yield cap
            sal = GaugeMetricFamily("orca_drift_sequential_alarm", "1 once the sequential drift "
                                    "test has alarmed (the guards respond as to their alarm)",
                                    labels=[LABEL])
            sal.add_metric([m], float(a.sequential.alarm))
            yield sal


def _give_up_families(st: AuditState, m: str) -> Iterable[Any]:
    """The give-up guards' metrics: the audited give-up risk (loss: the audit would have given
    up under mu*), its bounds and alarm per give-up delta, and the mu* served (-Inf: give-up
    off)."""
    fams = {
        "risk": GaugeMetricFamily("orca_audit_give_up_risk", "Audited give-up risk of the "
                                  "bundle's mu* (mean loss: the audit would have given up; at "
                                  "least the certified risk)", labels=[LABEL, "delta"]),
        "lower": GaugeMetricFamily("orca_audit_give_up_risk_lower", "Anytime-valid lower "
                                   "confidence bound of the audited give-up risk",
                                   labels=[LABEL, "delta"]),
        "upper": GaugeMetricFamily("orca_audit_give_up_risk_upper", "Anytime-valid upper "
                                   "confidence bound of the audited give-up risk",
                                   labels=[LABEL, "delta"]),
        "alarm": GaugeMetricFamily("orca_audit_give_up_alarm", "1 when the audited give-up "
                                   "risk's lower bound exceeds the give-up delta",
                                   labels=[LABEL, "delta"]),
    }
    mu = GaugeMetricFamily("orca_audit_give_up_mu", "mu* served for this give-up delta (-Inf: "
                           "never gives up) and where it comes from (fallback: give-up off; "
                           "audit: recalibrated)",
                           labels=[LABEL, "delta", "source"])
    for g in st.give_up_guards.values():
        row, d = g.row(), f"{g.delta:g}"
        fams["risk"].add_metric([m, d], row["risk"] if row["risk"] is not None else math.nan)
        for k in ("lower", "upper"):
            fams[k].add_metric([m, d], row[k])
        fams["alarm"].add_metric([m, d], float(row["alarm"]))
        mu.add_metric([m, d, g.source], g.mu)
    yield from fams.values()
    yield mu


def _vote_families(votes: VoteAudit, m: str) -> Iterable[Any]:
    """The vote's audit (`orca.samples`): audited groups by state, and per consensus row the
    audited vote error, its anytime-valid bounds, the alarm and whether groups settle early."""
    c = CounterMetricFamily("orca_vote_audit_groups", "Voted groups picked for the vote's audit "
                            "(run to their end), measured (their vote error known), "
                            "censored (a sample failed or the client left first) and refused "
                            "(vLLM refused the request: nothing ran)",
                            labels=[LABEL, "state"])
    for state in VoteCount:
        c.add_metric([m, state], votes.counts[state])
    yield c
    labels = [LABEL, "delta", "delta_vote"]
    fams = {
        "risk": GaugeMetricFamily("orca_vote_error", "Audited vote error (the settled vote "
                                  "differs from the vote of all k samples)", labels=labels),
        "lower": GaugeMetricFamily("orca_vote_error_lower", "Anytime-valid lower confidence "
                                   "bound of the audited vote error", labels=labels),
        "upper": GaugeMetricFamily("orca_vote_error_upper", "Anytime-valid upper confidence "
                                   "bound of the audited vote error", labels=labels),
        "alarm": GaugeMetricFamily("orca_vote_alarm", "1 when the vote error's lower bound "
                                   "exceeds delta_vote", labels=labels),
        "fallback": GaugeMetricFamily("orca_vote_fallback", "1 while groups of this row settle "
                                      "no more early (the guard acts on its alarm)",
                                      labels=labels),
    }
    for g in votes.guards.values():
        row, key = g.row(), [m, f"{g.delta:g}", f"{g.delta_vote:g}"]
        fams["risk"].add_metric(key, row["risk"] if row["risk"] is not None else math.nan)
        for k in ("lower", "upper", "alarm"):
            fams[k].add_metric(key, float(row[k]))
        fams["fallback"].add_metric(key, float(g.source == Source.FALLBACK))
    yield from fams.values()
