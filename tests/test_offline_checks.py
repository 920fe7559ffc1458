"""The offline tools run the server's bundle checks (orca_method.bundle_checks.check_bundle).

Found by a trial: `orca-calibrate evaluate` printed tables for bundles orca-serve refuses
(weights x 1e30, lambda* rising with delta, every lambda* 0, another model's name, a step
delimiter the data was not cut at), `audit-report` and `recalibrate` read them, and
`recalibrate` wrote a bundle the server then refused. Each such bundle is made here as the
trial made it (a calibrated bundle, one property edited, the checksum resealed) and given to
each tool the way a user would: exit 2, one line saying why, no table, no bundle written.
"""

from __future__ import annotations

import json
import shutil

import pytest

from orca_calibrate.calibrate_cli import main
from orca_calibrate.synth import generate
from orca_calibrate.train import save_probe, train_static
from orca_method.bundle import (
    Bundle,
    BundleError,
    _checksum,
    encode_weights,
    load_bundle,
)
from orca_method.bundle_checks import Target, check_bundle, data_target
from orca_method.trajectories import TrajectorySet
from tests.bundles import with_saturated_give_up

KW = {"dim": 16, "mean_steps": 20}
SEGMENTATION = {"delimiter": "\n\n", "keywords": None, "keyword_match": "word",
                "max_step_tokens": None}
CONFIG = {"architecture": "SynthForCausalLM", "hidden_size": 16, "num_layers": 2,
          "vocab_size": 100}


def _record(path, **info) -> None:
    """What collect and the server's audit store record beside the synthetic data's info."""
    f = path / "info.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **info}))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline")
    data = generate(root / "data", n_problems=400, splits=(0.5, 0.3, 0.2), **KW)
    _record(data, segmentation=SEGMENTATION, model_config=CONFIG)
    audits = generate(root / "audits", n_problems=200, seed=3, splits=None, **KW)
    _record(audits, segmentation=SEGMENTATION, model_config=CONFIG)
    probe = train_static(TrajectorySet.open(data), "consistent", seed=0)
    save_probe(probe, root / "static.safetensors", {"label_mode": "consistent", "seed": "0"})
    assert main(["calibrate", "--data", str(data), "--probe", str(root / "static.safetensors"),
                 "--out", str(root / "bundle.json"), "--delta", "0.1", "0.2", "0.3"]) == 0
    bundle = load_bundle(root / "bundle.json")
    assert bundle.model.config_fingerprint is not None  # carried from the data's record
    assert len({r.lam for r in bundle.ltt.rows}) > 1  # the edits below change something
    return root


def _rows(d) -> list[dict]:
    return sorted(d["ltt"]["rows"], key=lambda r: r["delta"])


def _scaled(d) -> None:
    probe = Bundle.model_validate(d).load_probe()
    for p in probe.params.values():
        p.data.mul_(1e30)
    d["probe"]["weights"] = encode_weights(probe)


def _rising(d) -> None:
    rows = _rows(d)
    rows[-1]["lam"] = min(1.0, max(r["lam"] or 0 for r in rows) + 0.1)


def _saturated_give_up(d) -> None:
    """Made two-sided, its give-up probe's weights x 1e30 (refused as the stop probe's are)."""
    damaged = with_saturated_give_up(Bundle.model_validate(d)).model_dump()
    d.clear()
    d.update(damaged)


DAMAGED = {  # the trial's bundles -> what the refusal says
    "weights x 1e30": (_scaled, "the probe's scores are all saturated"),
    "give-up weights x 1e30": (_saturated_give_up, "give-up probe's scores are all saturated"),
    "lambda rising with delta": (_rising, "rises with delta"),
    "all lambdas 0": (lambda d: [r.update(lam=0.0) for r in d["ltt"]["rows"]], "recalibrate"),
    "another model's name": (lambda d: d["model"].update(name="Qwen/QwQ-32B"),
                             "made for model 'Qwen/QwQ-32B'"),
    "an unknown delimiter": (lambda d: d["segmentation"].update(delimiter="#~#"),
                             "cut into steps"),
    "another model's config": (lambda d: d["model"]["config_fingerprint"].update(num_layers=64),
                               "num_layers 64 vs 2"),
}


def _damaged(world, tmp_path, name: str):
    path = tmp_path / "bundle.json"
    shutil.copy(world / "bundle.json", path)
    data = json.loads(path.read_text())
    DAMAGED[name][0](data)
    data["checksum"] = _checksum(data)
    path.write_text(json.dumps(data))
    load_bundle(path)  # it loads: only the check can refuse it
    return path


def _tools(world, bundle, out) -> list[list[str]]:
    return [["evaluate", "--data", str(world / "data"), "--bundle", str(bundle)],
            ["audit-report", "--audit", str(world / "audits"), "--bundle", str(bundle)],
            ["recalibrate", "--audit", str(world / "audits"), "--bundle", str(bundle),
             "--out", str(out), "--force"]]


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_every_offline_tool_refuses_what_the_server_refuses(world, tmp_path, capsys, name):
    bundle, out = _damaged(world, tmp_path, name), tmp_path / "new.json"
    for argv in _tools(world, bundle, out):
        assert main(argv) == 2, argv[0]
        got = capsys.readouterr()
        assert got.out == ""  # no table
        assert got.err.startswith(f"orca-calibrate {argv[0]}: error: ")
        assert got.err.count("\n") == 1 and DAMAGED[name][1] in got.err, got.err
    assert not out.exists()


def test_identity_is_forced_as_on_the_server(world, tmp_path, capsys):
    """--force-model lets another model's name (or config) through with a warning, as
    --orca-force-model does; a bad table never."""
    bundle, out = _damaged(world, tmp_path, "another model's name"), tmp_path / "new.json"
    for argv in _tools(world, bundle, out):
        assert main([*argv, "--force-model"]) == 0, argv[0]
        assert "warning: --force-model" in capsys.readouterr().err
    assert out.exists()
    bad = _damaged(world, tmp_path, "weights x 1e30")
    assert main([*_tools(world, bad, out)[0], "--force-model"]) == 2


def test_the_good_bundle_passes_and_recalibrate_writes_one_the_server_accepts(world, tmp_path):
    out = tmp_path / "new.json"
    for argv in _tools(world, world / "bundle.json", out):
        assert main(argv) == 0, argv[0]
    new = load_bundle(out)
    assert check_bundle(new, data_target(TrajectorySet.open(world / "audits").info, 16)) is None
    parent = load_bundle(world / "bundle.json")
    assert new.model.config_fingerprint == parent.model.config_fingerprint


def test_calibration_refuses_to_write_a_saturated_probe(world, tmp_path, capsys):
    """calibrate (and so recalibrate) runs the server's table and probe checks before writing."""
    from orca_calibrate.train import load_probe

    probe, meta = load_probe(world / "static.safetensors")
    for name, p in probe.params.items():
        if name != "log_eta":  # eta stays a number: only the scores saturate
            p.data.mul_(1e30)
    save_probe(probe, tmp_path / "big.safetensors", meta)
    out = tmp_path / "b.json"
    assert main(["calibrate", "--data", str(world / "data"), "--probe",
                 str(tmp_path / "big.safetensors"), "--out", str(out)]) == 2
    assert "saturated" in capsys.readouterr().err and not out.exists()


def test_a_config_mismatch_is_refused_whatever_the_name(world):
    """Issue 23: the name matches (--served-model-name), the config does not: refused unless
    forced; a bundle without a fingerprint is checked by name, hidden size and tokenizer only."""
    from orca_method.bundle import ConfigFingerprint

    bundle = load_bundle(world / "bundle.json")
    other = ConfigFingerprint(**{**CONFIG, "architecture": "LlamaForCausalLM"})
    target = Target(model="/models/other", served_names=("synthetic",), hidden_size=16,
                    config_fingerprint=other)
    with pytest.raises(BundleError, match="architecture 'SynthForCausalLM' vs 'LlamaForCaus"):
        check_bundle(bundle, target)
    assert "config differs" in check_bundle(bundle, target, force=True)
    old = bundle.model_copy(update={"model": bundle.model.model_copy(
        update={"config_fingerprint": None})})
    assert check_bundle(old, target) is None
    with pytest.raises(BundleError, match="hidden size"):
        check_bundle(old, Target(model="synthetic", hidden_size=32))


def test_audits_of_two_bundles_after_a_hot_reload(world, tmp_path, capsys):
    """A hot reload to a bundle of another model starts a new audit directory; audit-report
    reads the directories of the bundle it is given and names the others as skipped."""
    root = tmp_path / "root"
    for part, seed in (("audit-000001", 5), ("audit-000002", 6), ("audit-000003", 7)):
        generate(root / part, n_problems=30, seed=seed, **KW)
        _record(root / part, segmentation=SEGMENTATION, model_config=CONFIG)
    _record(root / "audit-000002", model="another-model")
    out = tmp_path / "r.json"
    assert main(["audit-report", "--audit", str(root), "--bundle", str(world / "bundle.json"),
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["audits"] == 60
    assert "skipped audit-000002" in capsys.readouterr().err
