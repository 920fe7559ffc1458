"""`orca-calibrate audit-report` and `recalibrate` on synthetic audits (fixed seeds).

A bundle calibrated on the in-distribution family is audited on fresh in-distribution data (no
alarm) and on the shifted family (its lambda* there breaks the risk: alarm, and the drift test
fires). Recalibrating on the shifted audits must bring the realized risk on FRESH shifted data
back to delta, within 3 binomial standard errors of the finite test set.
"""

import json
import math

import pytest

from orca_calibrate.calibrate_cli import main
from orca_calibrate.evaluate import evaluate_bundle
from orca_calibrate.synth import generate
from orca_calibrate.train import save_probe, train_static
from orca_method.bundle import load_bundle
from orca_method.outcomes import GiveUpPolicy
from orca_method.trajectories import TrajectorySet

KW = {"dim": 32, "mean_steps": 30}
DELTAS = (0.05, 0.1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    data = generate(root / "in", n_problems=1600, splits=(0.5, 0.5, 0.0), **KW)
    generate(root / "shifted-audits", n_problems=1200, shift=True, seed=1, splits=None, **KW)
    generate(root / "shifted-fresh", n_problems=1200, shift=True, seed=2, **KW)
    generate(root / "in-audits", n_problems=800, seed=3, splits=None, **KW)
    probe = train_static(TrajectorySet.open(data), "consistent", seed=0)
    save_probe(probe, root / "static.safetensors", {"label_mode": "consistent", "seed": "0"})
    assert main(["calibrate", "--data", str(data), "--probe", str(root / "static.safetensors"),
                 "--out", str(root / "bundle.json"), "--delta", *map(str, DELTAS)]) == 0
    return root


def _report(world, audits: str, *extra: str) -> dict:
    out = world / f"{audits}.json"
    assert main(["audit-report", "--audit", str(world / audits), "--bundle",
                 str(world / "bundle.json"), "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def first_alarm(world) -> int:
    """The audit of the shifted directory at which the bundle first alarmed (the earliest over
    its deltas), from one report that the recalibration tests share."""
    return min(r["first_alarm_audit"] for r in _report(world, "shifted-audits")["deltas"]
               if r["first_alarm_audit"] is not None)


def _fresh_errors(bundle_path) -> tuple[dict[float, float], int]:
    rep, _ = evaluate_bundle(load_bundle(bundle_path),
                             TrajectorySet.open(bundle_path.parent / "shifted-fresh"), "all")
    return {r["delta"]: r["error"] for r in rep["deltas"].values()}, rep["n"]


def _tolerance(delta: float, n: int) -> float:
    return 3 * math.sqrt(delta * (1 - delta) / n)


def test_no_alarm_in_distribution(world):
    report = _report(world, "in-audits")
    assert report["counted"] == 800 and report["label_mode"] == "consistent"
    assert not any(r["alarm"] for r in report["deltas"])
    assert report["drift"]["tests"] == 1 and not report["drift"]["alarm"]
    assert len(report["history"]["lower"][0]) == 800


def test_alarm_and_drift_on_the_shifted_family(world, capsys):
    report = _report(world, "shifted-audits", "--plots", str(world / "plots"))
    strict = report["deltas"][0]
    assert strict["delta"] == 0.05 and strict["alarm"] and strict["lower"] > 0.05
    assert strict["first_alarm_at"] is not None and strict["risk"] > strict["lower"]
    assert report["drift"]["alarm"] and report["drift"]["pvalue"] < 0.05
    out = capsys.readouterr().out
    assert "ALARM" in out and "drift" in out
    assert (world / "plots" / "audit_risk.png").read_bytes()[:4] == b"\x89PNG"


def test_recalibrate_refuses_a_window_reaching_back_to_the_alarm(world, first_alarm, capsys):
    """The whole shifted directory holds the audits up to the first alarm: refused in one
    line that says how many recent audits are usable; --force takes it anyway."""
    at = first_alarm
    argv = ["recalibrate", "--bundle", str(world / "bundle.json"), "--audit",
            str(world / "shifted-audits"), "--out", str(world / "forced.json")]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"first alarm (audit {at})" in err
    assert f"--last {1200 - at} or fewer" in err and not (world / "forced.json").exists()
    assert main([*argv, "--last", str(1200 - at + 1)]) == 2  # one audit too far back
    assert main([*argv, "--force"]) == 0 and load_bundle(world / "forced.json").ltt.n_cal == 1200


def test_recalibrate_brings_the_risk_back(world, first_alarm):
    before, n = _fresh_errors(world / "bundle.json")
    assert before[0.05] > 0.05 + _tolerance(0.05, n)  # the shift really broke the guarantee
    at = first_alarm
    out = world / "recalibrated.json"
    assert main(["recalibrate", "--bundle", str(world / "bundle.json"), "--audit",
                 str(world / "shifted-audits"), "--out", str(out), "--last", str(1200 - at)]) == 0
    old, new = load_bundle(world / "bundle.json"), load_bundle(out)
    assert new.probe == old.probe and new.ltt.n_cal == 1200 - at and new.drift is not None
    assert new.provenance["calibration_source"] == "live audits"
    assert new.provenance["parent_checksum"] == old.checksum
    for d in DELTAS:
        assert new.lam(d) >= old.lam(d)  # more conservative on the harder family
    after, n = _fresh_errors(out)
    for d in DELTAS:
        assert after[d] <= d + _tolerance(d, n), (d, after[d])


def test_a_recalibrated_bundle_is_gated_for_the_windows_traffic(world, first_alarm):
    """The parent's gate settings, fitted on a seeded half of the window's audits and scored on
    the other half (the window has no training half): traffic like the window's is flagged at
    about alpha, traffic unlike it is flagged."""
    import torch

    from orca_calibrate.gate import gate_features_of

    out = world / "gated-recalibrated.json"
    window = 1200 - first_alarm
    assert main(["recalibrate", "--bundle", str(world / "bundle.json"), "--audit",
                 str(world / "shifted-audits"), "--out", str(out), "--last", str(window)]) == 0
    old, new = load_bundle(world / "bundle.json").shift_gate, load_bundle(out)
    g = new.shift_gate
    assert (g.steps, g.alpha, g.give_up_alpha) == (old.steps, old.alpha, old.give_up_alpha)
    assert g.n_fit == round(window / 2) and len(g.scores) == window - g.n_fit
    assert new.provenance["shift_gate"] == "fitted on a seeded half of the window's audits"
    gate = new.load_gate()
    fresh = TrajectorySet.open(world / "shifted-fresh")  # the window's family, unseen
    x = torch.from_numpy(gate_features_of([fresh.embeddings(i) for i in range(len(fresh))],
                                          gate.steps))
    flagged = float((gate.score(x) > gate.thresholds()[0]).float().mean())
    assert flagged <= g.alpha + _tolerance(g.alpha, len(fresh))
    assert bool((gate.score(x + 10.0) > gate.thresholds()[0]).all())


def test_recalibrate_on_a_window_with_retraining(world):
    out = world / "retrained.json"
    assert main(["recalibrate", "--bundle", str(world / "bundle.json"), "--audit",
                 str(world / "shifted-audits"), "--out", str(out), "--last", "1000",
                 "--retrain"]) == 0
    new = load_bundle(out)
    assert new.provenance["retrained"] and new.provenance["audit_window"] == 1000
    assert 400 <= new.ltt.n_cal <= 600  # calibrated on the half it was not trained on
    after, n = _fresh_errors(out)
    for d in DELTAS:
        assert after[d] <= d + _tolerance(d, n), (d, after[d])


def test_the_servers_rotating_directories_read_as_one(world, tmp_path):
    """`--audit` takes the server's audit root: its audit-NNNNNN parts in order."""
    for part, seed in (("audit-000002", 5), ("audit-000001", 4)):
        generate(tmp_path / "root" / part, n_problems=60, shift=True, seed=seed, splits=None,
                 **KW)
    out = tmp_path / "r.json"
    assert main(["audit-report", "--audit", str(tmp_path / "root"), "--bundle",
                 str(world / "bundle.json"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["audits"] == 120
    assert main(["recalibrate", "--audit", str(tmp_path / "root"), "--bundle",
                 str(world / "bundle.json"), "--out", str(tmp_path / "b.json"),
                 "--last", "70", "--force"]) == 0
    ids = load_bundle(tmp_path / "b.json").provenance
    assert ids["audit_first_id"].startswith("synth-shifted-4-")  # the window spans both parts
    assert ids["audit_last_id"] == "synth-shifted-5-000059"


def test_bad_input_is_one_line(world, tmp_path, capsys):
    bundle = str(world / "bundle.json")
    generate(tmp_path / "narrow", n_problems=5, dim=16, mean_steps=5, splits=None)
    cases = [["audit-report", "--audit", str(tmp_path / "missing"), "--bundle", bundle],
             ["audit-report", "--audit", str(tmp_path / "narrow"), "--bundle", bundle],
             ["recalibrate", "--audit", str(world / "in-audits"), "--bundle", bundle,
              "--out", str(tmp_path / "x.json"), "--last", "0"],
             ["audit-report", "--audit", str(world / "in-audits"), "--bundle", bundle,
              "--label-mode", "judge"]]
    for argv in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"orca-calibrate {argv[0]}: error:") and err.count("\n") == 1


@pytest.mark.parametrize("cmd", ["audit-report", "recalibrate"])
def test_a_jobs_training_traces_are_not_audits(world, tmp_path, capsys, cmd):
    """The bundle's own training set passed as audits (its probe was fitted on half of it)
    would make the bundle look safer than it is: refused (`open_audits`, which every tool
    reading audits goes through)."""
    bundle, data = str(world / "bundle.json"), str(world / "in")
    out = ["--out", str(tmp_path / "b")] if cmd == "recalibrate" else []
    assert main([cmd, "--audit", data, "--bundle", bundle, *out]) == 2
    err = capsys.readouterr().err
    assert "800 of the 1600 traces" in err and "training split" in err and err.count("\n") == 1
    assert not (tmp_path / "b").exists()


def _past_the_end(bundle, ts, audits: list[int]) -> list[list[tuple[bool, int]]]:
    """Per audit of `audits`, per delta of the bundle: whether the stop at its lambda* comes at
    or after the last recorded step of the audit (so a cut there is censored), and the loss at
    that lambda (the set scored once)."""
    from orca_calibrate.calibrate import score_split
    from orca_method.risk import is_counted, request_loss, stops_before_end

    scored = score_split(bundle.load_probe(), ts, "all", "consistent", bundle.window,
                         solvable_only=False)
    out = []
    for i in audits:
        s, c = scored.scores[i], scored.labels[i]
        counted = is_counted(c, bundle.ltt.excluded_never_correct)  # never right: unknown
        out.append([(not (counted and stops_before_end(s, bundle.lam(d))),
                     request_loss(s, c, bundle.lam(d)) if counted else 1)
                    for d in bundle.deltas()])
    return out


def test_unfinished_audits_enter_censored_offline(world):
    """An audit record whose finish_reason says it was cut enters as the server counts it: with
    its loss at a lambda* that stops before the cut, censored at one that would stop later (at
    loss 0 for the alarm's lower bound and at its loss at the cut for the upper bound, so the
    range is that over n wide); `stop` and records without one count as finished. `joint`
    splits alpha."""
    from dataclasses import replace

    from orca_calibrate.audit_report import audit_report, open_audits

    ts = open_audits(world / "in-audits")
    bundle = load_bundle(world / "bundle.json")
    plain = audit_report(bundle, ts, mode="consistent")
    ts.problems[0] = replace(ts.problems[0], extra={"finish_reason": "length"})
    ts.problems[1] = replace(ts.problems[1], extra={"finish_reason": "stop"})
    rep = audit_report(bundle, ts, mode="consistent")
    n = rep["counted"]
    assert (rep["audits"], rep["unfinished_censored"]) == (800, 1)
    recovered = plain["never_correct_skipped"] - rep["never_correct_skipped"]  # 0 or 1
    assert n == plain["counted"] + recovered
    for row, was, (past, loss) in zip(rep["deltas"], plain["deltas"],
                                      _past_the_end(bundle, ts, [0])[0]):
        low, high = row["risk_range"]
        assert row["censored"] == int(past) and high - low == pytest.approx(past * loss / n)
        if not recovered:  # the same audits, one of them censored or not
            assert row["lower"] <= was["lower"] + 1e-9 and row["upper"] >= was["upper"] - 1e-9
    joint = audit_report(bundle, ts, mode="consistent", epsilon_split="joint")
    assert joint["alpha"] == pytest.approx(rep["alpha"] / len(rep["deltas"]))
    assert all(j["lower"] <= r["lower"] and j["upper"] >= r["upper"]
               for j, r in zip(joint["deltas"], rep["deltas"]))


def test_audit_report_replays_the_give_up_guard(world):
    """A two-sided bundle: the report replays the give-up probe on every audit (never-right ones
    too) and measures each give-up delta as the server's give-up guard does. With the audits'
    reference labels (a collection) the loss is the certified one of the bundle's give-up
    policy, gave up with a right answer ahead ("guess") or on a trace right at some step
    ("message"; here the give-up is at the first step, so both count any right step);
    without them (the give-up's label mode not in the audits, as on a server's audits) it is
    whether the audit gave up. The probe scores 0.5 at every step: mu* 0.6 gives up at the
    first step (of every audit with two steps or more), mu* 0.4 never."""
    from orca_method.bundle import save_bundle
    from tests.bundles import with_give_up

    one = load_bundle(world / "bundle.json")
    ts = TrajectorySet.open(world / "in-audits")
    long = [p.n_steps >= 2 for p in ts.problems]
    right = [ts.raw_labels(i, "supervised").any() for i in range(len(ts))]
    certified = "gave_up_with_a_right_answer_ahead"
    message = "gave_up_on_a_trace_right_at_some_step"  # certified for policy "message"
    want = {certified: sum(a and b for a, b in zip(long, right)) / len(ts),
            "gave_up": sum(long) / len(ts)}
    want[message] = want[certified]  # a give-up at the first step: the two losses agree
    assert 0.05 < want[certified] < want["gave_up"]
    for label_mode, policy, loss in (("supervised", GiveUpPolicy.GUESS, certified),
                                     ("supervised", GiveUpPolicy.MESSAGE, message),
                                     ("judge", GiveUpPolicy.MESSAGE, "gave_up")):
        two = with_give_up(one, [(0.05, 0.4), (0.1, 0.6)])
        two = two.model_copy(update={"give_up": two.give_up.model_copy(
            update={"label_mode": label_mode, "policy": policy})})
        save_bundle(two, world / "two-sided.json")
        out = world / "two-sided-report.json"
        assert main(["audit-report", "--audit", str(world / "in-audits"), "--bundle",
                     str(world / "two-sided.json"), "--json", str(out)]) == 0
        g = json.loads(out.read_text())["give_up"]
        assert g["loss"] == loss and g["policy"] == policy and g["n"] == len(ts)
        never, always = g["deltas"]
        assert never["risk"] == 0.0 and not never["alarm"]
        assert always["risk"] == pytest.approx(want[loss]) and always["alarm"]
        assert always["lower"] <= want[loss] <= always["upper"]


def test_recalibrate_keeps_a_two_sided_bundles_give_up_block(world, tmp_path, capsys):
    """Recalibrating a two-sided bundle writes a two-sided one: its give-up block as calibrated
    (mu* holds with any lambda*; live audits, without reference labels, cannot re-certify it),
    said on stdout and in the provenance; `--drop-give-up` alone writes a one-sided bundle, and
    says so on stderr (a server running it refuses every give-up request)."""
    from orca_method.bundle import save_bundle
    from orca_method.bundle_checks import check_semantics
    from tests.bundles import with_give_up

    two = save_bundle(with_give_up(load_bundle(world / "bundle.json"), [(0.05, None), (0.1, 0.4)]),
                      tmp_path / "two.json")
    argv = ["recalibrate", "--bundle", str(tmp_path / "two.json"), "--audit",
            str(world / "in-audits"), "--last", "400"]
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "kept.json")]) == 0
    assert "give-up: kept the parent's block" in capsys.readouterr().out
    kept = load_bundle(tmp_path / "kept.json")
    assert kept.give_up == two.give_up and kept.schema_version == 2
    assert kept.provenance["give_up"] == "the parent bundle's, kept as calibrated"
    assert kept.ltt.n_cal != two.ltt.n_cal  # the stop side was recalibrated on the window
    check_semantics(kept)  # what the server checks at start and on reload
    assert kept.mu(0.1) == 0.4
    assert main([*argv, "--out", str(tmp_path / "dropped.json"), "--drop-give-up"]) == 0
    err = capsys.readouterr().err
    assert "warning: --drop-give-up" in err and "one-sided" in err
    dropped = load_bundle(tmp_path / "dropped.json")
    assert dropped.give_up is None and dropped.schema_version == 1
    assert dropped.provenance["give_up"] == "dropped (--drop-give-up)"


def test_recalibrate_keeps_the_group_tables_of_the_same_probe(world, tmp_path, capsys):
    """A group's table is certified on its own traces with the probe (the live audit leaves
    known groups out): recalibrating the mixture keeps it as calibrated, its mu* too, or without
    them when `--drop-give-up` makes the bundle one-sided; a retrained probe voids it; a
    consensus block, whose rows stop samples at the parent's lambda*, is dropped. Each said on
    stdout and in the provenance, and the result passes the server's checks."""
    from orca_method.bundle import save_bundle
    from orca_method.bundle_checks import check_semantics
    from tests.bundles import with_consensus, with_give_up, with_groups

    parent = with_groups(with_give_up(load_bundle(world / "bundle.json"), [(0.05, None),
                                                                           (0.1, 0.4)]),
                         {"hard": {"lam": [(0.05, None), (0.1, 0.9)], "mu": [(0.05, None),
                                                                            (0.1, 0.3)]}})
    parent = with_consensus(parent)
    parent = save_bundle(parent.model_copy(update={
        "provenance": {**parent.provenance, "group_data": [{"data": "hard-set"}]}}),
        tmp_path / "grouped.json")
    argv = ["recalibrate", "--bundle", str(tmp_path / "grouped.json"), "--audit",
            str(world / "in-audits"), "--last", "400"]
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "kept.json")]) == 0
    out = capsys.readouterr().out
    assert "groups hard: the parent bundle's, kept as calibrated" in out
    assert "consensus: dropped" in out
    kept = load_bundle(tmp_path / "kept.json")
    check_semantics(kept)
    assert kept.groups == parent.groups and kept.consensus is None
    assert kept.lam(0.1, "hard") == 0.9 and kept.mu(0.1, "hard") == 0.3
    assert kept.ltt.n_cal != parent.ltt.n_cal  # the mixture was recalibrated
    assert kept.provenance["group_data"] == [{"data": "hard-set"}]

    assert main([*argv, "--out", str(tmp_path / "one.json"), "--drop-give-up"]) == 0
    one = load_bundle(tmp_path / "one.json")
    check_semantics(one)
    assert one.groups["hard"].ltt == parent.groups["hard"].ltt
    assert one.give_up is None and one.groups["hard"].give_up is None

    assert main([*argv, "--out", str(tmp_path / "retrained.json"), "--retrain"]) == 0
    assert "groups hard: dropped" in capsys.readouterr().out
    retrained = load_bundle(tmp_path / "retrained.json")
    assert retrained.groups is None and "retrained" in retrained.provenance["groups"]


def test_a_disconnected_audit_is_censored_offline_as_on_the_server(world):
    """`finish_reason: null` (the server's record of a response that never finished: the
    client went away) is censored by the server's own rule, `incomplete`; a record without the
    field (synthetic, imported) counts as finished."""
    from dataclasses import replace

    from orca_calibrate.audit_report import audit_report, open_audits, unfinished
    from orca_method.audit.attrition import incomplete

    ts = open_audits(world / "in-audits")
    ts.problems[3] = replace(ts.problems[3], extra={"finish_reason": None})
    ts.problems[4] = replace(ts.problems[4], extra={"finish_reason": "abort"})
    assert incomplete(None) == incomplete("abort") == "aborted"  # the server's counts
    assert list(unfinished(ts)) == [3, 4]
    import numpy as np

    bundle = load_bundle(world / "bundle.json")
    rep = audit_report(bundle, ts, mode="consistent")
    past = np.array(_past_the_end(bundle, ts, [3, 4]))[..., 0].sum(axis=0)
    assert rep["unfinished_censored"] == 2
    assert [r["censored"] for r in rep["deltas"]] == past.tolist()


def test_after_a_reload_each_bundle_counts_only_the_audits_its_live_audit_took(world, tmp_path,
                                                                             capsys):
    """Audits record which bundle's live audit took them (`extra.audit.bundle_checksum`, one
    journal per bundle on the server). After `recalibrate --last 300` and a reload, the report
    of the recalibrated bundle counts the audits taken after the reload only, never the 300 it
    was fitted on, and the parent's report only its own. Records without a checksum (older
    servers) lose, for the recalibrated bundle, every audit up to the last one it was fitted on."""
    from dataclasses import replace

    from orca_calibrate.audit_report import audit_report, open_audits
    from orca_method.trajectories import INFO_DEFAULTS
    from orca_serve.live_audit.store import AuditStore

    parent = load_bundle(world / "bundle.json")
    assert main(["recalibrate", "--bundle", str(world / "bundle.json"), "--audit",
                 str(world / "in-audits"), "--last", "300", "--out", str(tmp_path / "r.json")]) == 0
    recal = load_bundle(tmp_path / "r.json")
    ts = open_audits(world / "in-audits")
    for i, p in enumerate(ts.problems):  # the first 700 the parent took, then the reload
        owner = parent if i < 700 else recal
        ts.problems[i] = replace(p, extra={**(p.extra or {}),
                                           "audit": {"bundle_checksum": owner.checksum}})
    # written by the server's audit store, read back as audit-report reads its directory
    store = AuditStore(tmp_path / "dir", dim=ts.dim, info={
        k: v for k, v in ts.info.items() if k in INFO_DEFAULTS})
    for i, p in enumerate(ts.problems):
        store.append(p.to_dict(), ts.embeddings(i))
    store.close()
    capsys.readouterr()
    mine, theirs = (open_audits(tmp_path / "dir", b) for b in (recal, parent))
    assert (len(mine), len(theirs)) == (100, 700)
    assert "skipped 700 taken by other bundles" in capsys.readouterr().err
    assert {p.id for p in mine.problems} == {p.id for p in ts.problems[700:]}
    rep = audit_report(recal, mine, mode="consistent")
    assert rep["audits"] == 100 and all(r["n"] <= 100 for r in rep["deltas"])
    # records without the checksum: none after the window it was fitted on, none counted
    with pytest.raises(ValueError, match="none of the 800 audits .* recalibrated on or older"):
        open_audits(world / "in-audits", recal)
    assert len(open_audits(world / "in-audits", parent)) == 800  # the parent: all, as before
