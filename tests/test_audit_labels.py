"""Live audits label by consistency; a bundle certified under other labels is reported on, and
the guard acts on it only when the operator says so (--orca-guard-other-labels). Every change of
a guard is one line of the server log."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from orca_method.bundle import load_bundle
from orca_serve.live_audit.collector import AuditCollector
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig

DEMO_BUNDLE = Path(__file__).parents[1] / "orca_serve" / "demo" / "bundle.json"
# every bundle lambda* stops at step 1 (score 1), right only at the last step: loss 1 everywhere
SCORES, LABELS = [1.0, 1.0, 1.0], [0, 0, 0, 1]


def _audit(label_mode: str, **config) -> LiveAudit:
    bundle = load_bundle(DEMO_BUNDLE).model_copy(update={"label_mode": label_mode})
    return LiveAudit(bundle, AuditConfig(rate=1.0, seed=0, on_alarm="fallback", **config))


def _metrics(audit: LiveAudit) -> str:
    reg = CollectorRegistry()
    reg.register(AuditCollector(lambda: audit, "toy"))
    return generate_latest(reg).decode()


def test_the_demo_bundle_is_calibrated_as_live_audits_label() -> None:
    bundle = load_bundle(DEMO_BUNDLE)
    assert bundle.label_mode == "consistent" and bundle.drift is not None


@pytest.mark.parametrize("mode, other_labels, acts", [
    ("consistent", False, True), ("supervised", False, False), ("supervised", True, True)])
def test_the_guard_acts_only_on_labels_that_match_or_when_told(mode, other_labels, acts) -> None:
    audit = _audit(mode, other_labels=other_labels)
    for _ in range(40):
        audit.observe(SCORES, LABELS)
    table = audit.table()
    assert (table["label_mode"], table["bundle_label_mode"]) == ("consistent", mode)
    assert table["labels_match"] is (mode == "consistent") and table["guard_acts"] is acts
    for row in table["deltas"]:
        assert row["alarm"], row  # the risk is measured and reported either way
        assert row["lambda_source"] == ("fallback" if acts else "bundle"), row
    text = _metrics(audit)
    match = f'orca_audit_labels_match{{audit_label_mode="consistent",bundle_label_mode="{mode}",' \
            f'model_name="toy"}} {1.0 if mode == "consistent" else 0.0}'
    assert match in text, text


def test_a_mismatch_is_said_at_start_and_alarms_and_fallback_are_log_lines(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="orca_serve"):
        _audit("supervised")
        (start,) = [r.getMessage() for r in caplog.records]
        assert "supervised labels" in start and "reports only" in start
        caplog.clear()
        audit = _audit("consistent")
        for _ in range(40):
            audit.observe(SCORES, LABELS)
    lines = [r for r in caplog.records if r.name == "orca_serve.live_audit"]
    alarms = [r.getMessage() for r in lines if "ALARM" in r.getMessage()]
    served = [r.getMessage() for r in lines if "now served with" in r.getMessage()]
    deltas = [f"{d:g}" for d in audit.bundle.deltas()]
    assert len(alarms) == len(served) == len(deltas), [r.getMessage() for r in lines]
    for d, alarm, fallback in zip(deltas, alarms, served):
        assert f"ALARM at delta {d} " in alarm and "on alarm: fallback" in alarm
        assert f"delta {d} now served with lambda never" in fallback and "(fallback;" in fallback
    assert all(r.levelno == logging.WARNING and "\n" not in r.getMessage() for r in lines)
