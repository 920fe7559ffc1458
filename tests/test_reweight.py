"""`orca-calibrate reweight` (orca_calibrate/reweight.py): a job's bundle recertified for traffic
given by its gate features, end to end on a synthetic job directory (a fixed static probe reading
the synthetic "solved" direction, as in tests/test_calibrate_groups.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from orca_calibrate.calibrate import GiveUpOptions, calibrate_bundle
from orca_calibrate.calibrate_cli import main
from orca_calibrate.reweight import features_of
from orca_calibrate.synth import generate, world
from orca_calibrate.train import train_give_up
from orca_method.bundle import load_bundle
from orca_method.probe import Probe, ProbeSpec
from orca_method.trajectories import TrajectorySet

DIM = 16


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A job directory (trajectories/ with train, calibration and test splits, a two-sided
    bundle.json) and
    the gate features of a shifted and of a fresh in-distribution set, as .npy files."""
    root = tmp_path_factory.mktemp("job")
    ts = TrajectorySet.open(generate(root / "trajectories", 600, dim=DIM, mean_steps=20,
                                     seed=0, splits=(0.4, 0.4, 0.2)))
    probe = Probe(ProbeSpec(dim=DIM, online=False), seed=0)
    probe.params["w"].data = torch.tensor(world(DIM).v * 8, dtype=torch.float32)
    probe.params["b"].data.fill_(-2.0)
    calibrate_bundle(probe, ts, root / "bundle.json", deltas=(0.1, 0.2), window=2,
                     give_up=(train_give_up(ts, "supervised"), GiveUpOptions()))
    for name, shift, seed in (("shifted", True, 1), ("in-dist", False, 2)):
        other = TrajectorySet.open(generate(root / name, 300, dim=DIM, mean_steps=20, seed=seed,
                                            shift=shift, splits=(0.0, 0.0, 1.0)))
        np.save(root / f"{name}.npy", features_of(other, range(len(other)), 1)[1])
    return root


def test_reweight_writes_a_bundle_that_says_what_it_was_reweighted_to(job, capsys):
    parent = load_bundle(job / "bundle.json")
    out = job / "reweighted.json"
    assert main(["reweight", "--job", str(job), "--traffic-features",
                 str(job / "shifted.npy"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "kept" in printed and "(was " in printed
    new = load_bundle(out)
    facts = new.provenance["reweight"]
    assert new.provenance["parent_checksum"] == parent.checksum
    assert facts["n_traffic"] == 300 and facts["gate_steps"] == 1
    assert 0 < facts["n_kept"] < facts["n_cal"] and facts["bound"] > 1
    assert new.ltt.n_cal <= facts["n_kept"]  # the kept solvable ones
    assert new.deltas() == parent.deltas() and new.window == parent.window
    assert new.ltt.epsilon == parent.ltt.epsilon and new.default_delta == parent.default_delta
    # the parent's gate as it is: the traffic it passes is the population certified
    assert new.shift_gate == parent.shift_gate is not None
    assert 5 <= facts["n_traffic_passed"] <= 300
    # mu* recertified on the same kept traces (all of them: the give-up risk is over every
    # request), with the parent's give-up probe
    assert new.provenance["give_up"].startswith("recertified")
    assert new.give_up.ltt.n_cal == facts["n_kept"] and new.give_up.probe == parent.give_up.probe
    # the schema is the parent's: the keys a reader of the parent knows, nothing else
    assert set(json.loads(out.read_text())) == set(json.loads((job / "bundle.json").read_text()))


def test_in_distribution_traffic_keeps_most_traces_and_about_the_same_lambda(job):
    parent = load_bundle(job / "bundle.json")
    assert main(["reweight", "--job", str(job), "--traffic-features",
                 str(job / "in-dist.npy"), "--out", str(job / "same.json")]) == 0
    new = load_bundle(job / "same.json")
    facts = new.provenance["reweight"]
    assert facts["n_kept"] >= 0.7 * facts["n_cal"] and facts["n_eff"] >= 0.9 * facts["n_cal"]
    for d in parent.deltas():
        assert abs(new.lam(d) - parent.lam(d)) <= 0.1


@pytest.mark.parametrize("extra, words", [
    ([], "one of the three"),
    (["--traffic-features", "X", "--traffic-prompts", "Y"], "one of the three"),
    (["--traffic-prompts", "Y"], "give --model"),
    (["--traffic-features", "missing.npy"], "cannot read traffic features"),
])
def test_bad_input_is_one_line(job, extra, words, capsys):
    assert main(["reweight", "--job", str(job), "--out", str(job / "x.json"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("orca-calibrate reweight: error: ")
    assert words in err[0]
    assert not (job / "x.json").exists()


def test_traffic_from_a_servers_audit_directory(job):
    """--traffic-audits reads the recorded step embeddings of audited requests (a trajectory
    directory, as the server writes them): the same features as the .npy of the same traces."""
    assert main(["reweight", "--job", str(job), "--traffic-audits", str(job / "shifted"),
                 "--out", str(job / "from-audits.json")]) == 0
    assert main(["reweight", "--job", str(job), "--traffic-features", str(job / "shifted.npy"),
                 "--out", str(job / "from-npy.json")]) == 0
    a, b = (load_bundle(job / f).provenance["reweight"] for f in ("from-audits.json",
                                                                  "from-npy.json"))
    assert a["traffic_sha256"] == b["traffic_sha256"] and a["n_kept"] == b["n_kept"]


def test_traffic_prompts_are_run_to_the_gates_step(job, monkeypatch):
    """--traffic-prompts: the prompts go to a record-mode engine with the bundle's settings,
    read to the bundle's gate step (a fake engine here: tests/test_toy_job.py runs the real
    one), and the prompts file is the traffic's recorded source."""
    import contextlib

    import orca_calibrate.gate as gate

    seen = {}

    @contextlib.contextmanager
    def collector(model, bundle, **kw):
        seen.update(model=model, max_tokens=kw["max_tokens"])
        yield "engine"

    def features(engine, prompts, steps):
        seen.update(n=len(prompts), steps=steps)
        return np.load(job / "shifted.npy")

    monkeypatch.setattr(gate, "gate_collector", collector)
    monkeypatch.setattr(gate, "first_step_features", features)
    prompts = job / "traffic.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "x"}) + "\n"
                               for i in range(3)))
    assert main(["reweight", "--job", str(job), "--traffic-prompts", str(prompts), "--model",
                 "M", "--max-tokens", "99", "--out", str(job / "p.json")]) == 0
    assert seen == {"model": "M", "max_tokens": 99, "n": 3,
                    "steps": load_bundle(job / "bundle.json").shift_gate.steps}
    assert load_bundle(job / "p.json").provenance["reweight"]["traffic"] == str(prompts)


def test_traffic_the_gate_flags_is_left_to_the_gate(job, capsys):
    """Features far from anything calibrated: the gate flags them all (they get its safe
    action), and there is nothing to reweight for: one line, exit 2, no bundle."""
    np.save(job / "far.npy", np.load(job / "shifted.npy") + 10.0)
    assert main(["reweight", "--job", str(job), "--traffic-features", str(job / "far.npy"),
                 "--out", str(job / "x.json")]) == 2
    assert "gate flags 300 of 300" in capsys.readouterr().err
    assert not (job / "x.json").exists()


def test_features_of_another_width_are_refused(job, capsys):
    np.save(job / "narrow.npy", np.zeros((10, DIM - 1)))
    assert main(["reweight", "--job", str(job), "--traffic-features", str(job / "narrow.npy"),
                 "--out", str(job / "x.json")]) == 2
    assert f"needs [N, {DIM}]" in capsys.readouterr().err


def test_reweight_keeps_the_parents_group_tables(job, tmp_path, capsys):
    """Reweighting re-draws the mixture's calibration traces, not a group's: the group tables
    (lambda*_g and mu*_g, with the parent's probes) are kept as calibrated, and said so."""
    from orca_method.bundle import save_bundle
    from tests.bundles import with_groups

    grouped = tmp_path / "job"
    grouped.mkdir()
    (grouped / "trajectories").symlink_to(job / "trajectories")
    parent = save_bundle(with_groups(load_bundle(job / "bundle.json"), {
        "hard": {"lam": [(0.1, 0.95), (0.2, 0.9)],
                 "mu": [(d, None) for d in load_bundle(job / "bundle.json").give_up_deltas()]}}),
        grouped / "bundle.json")
    capsys.readouterr()
    assert main(["reweight", "--job", str(grouped), "--traffic-features",
                 str(job / "shifted.npy"), "--out", str(tmp_path / "r.json")]) == 0
    assert "groups hard: the parent bundle's, kept as calibrated" in capsys.readouterr().out
    new = load_bundle(tmp_path / "r.json")
    assert new.groups == parent.groups and new.lam(0.2, "hard") == 0.9
    assert new.ltt != parent.ltt  # the mixture was recertified


def test_a_weight_cap_that_is_not_a_number_is_refused(job, capsys):
    """`--clip nan` compared as no cap and was served as one."""
    assert main(["reweight", "--job", str(job), "--traffic-features", str(job / "shifted.npy"),
                 "--out", str(job / "nan.json"), "--clip", "nan"]) == 2
    assert "the weight cap must be a number > 0, got nan" in capsys.readouterr().err
