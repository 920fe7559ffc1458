"""The bundle's `labelling` block: how the calibration data's steps were labelled (the answer
probes' suffix and answer tokens), recorded by collect, copied by calibrate, and the one source
of the live audit's labelling (flags only for bundles without it), offline tools included."""

import argparse
import json
from pathlib import Path

import pytest

from orca_calibrate.audit_report import open_audits
from orca_calibrate.calibrate_cli import main
from orca_calibrate.collect import CollectSettings
from orca_calibrate.synth import generate
from orca_calibrate.train import save_probe, train_static
from orca_method.answer_probes import DEFAULT_ANSWER_TOKENS, DEFAULT_SUFFIX
from orca_method.bundle import BundleError, Labelling, load_bundle, save_bundle
from orca_method.trajectories import TrajectorySet
from orca_serve.live_audit.options import add_audit_args, audit_config, store_info
from orca_serve.startup.preflight import preflight
from orca_serve.checks.errors import StartupError
from tests.bundles import small_bundle

OLD_DEMO = Path(__file__).parent / "data" / "demo-bundle-v1.json"  # written before the block
THEIRS = Labelling(suffix="\nFinal answer: \\boxed{", answer_tokens=5)


def _options(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_audit_args(p)
    return p.parse_args(["--orca-audit-rate", "1.0", *argv])


def _labelled(tmp_path: Path, labelling: Labelling | None) -> Path:
    """The small test bundle, with `labelling`, saved in `tmp_path`."""
    path = tmp_path / "bundle.json"
    save_bundle(small_bundle().model_copy(update={"labelling": labelling}), path)
    return path


def test_the_bundles_block_drives_the_audits_answer_probes(tmp_path):
    bundle = load_bundle(_labelled(tmp_path, THEIRS))
    assert bundle.labelling == THEIRS
    probe = audit_config(_options("--orca-audit-label-every", "3"), bundle).probe
    assert (probe.suffix, probe.answer_tokens, probe.label_every) == (THEIRS.suffix, 5, 3)
    # a flag saying the same is harmless
    same = _options("--orca-audit-answer-tokens", "5")
    assert audit_config(same, bundle).probe.answer_tokens == 5


def test_a_bundle_without_the_block_means_the_defaults_or_the_flags():
    old = load_bundle(OLD_DEMO)
    assert old.labelling is None
    probe = audit_config(_options(), old).probe
    assert (probe.suffix, probe.answer_tokens) == (DEFAULT_SUFFIX, DEFAULT_ANSWER_TOKENS)
    flagged = audit_config(_options("--orca-audit-suffix", "S{", "--orca-audit-answer-tokens",
                                    "7"), old).probe
    assert (flagged.suffix, flagged.answer_tokens) == ("S{", 7)


@pytest.mark.parametrize("flag, value", [("--orca-audit-suffix", "other{"),
                                         ("--orca-audit-answer-tokens", "16")])
def test_a_flag_contradicting_the_block_is_refused_before_vllm(tmp_path, flag, value):
    path = _labelled(tmp_path, THEIRS)
    with pytest.raises(BundleError, match=f"{flag} .* contradicts the bundle's labelling"):
        audit_config(_options(flag, value), load_bundle(path))
    with pytest.raises(StartupError) as e:  # pre-flight: no model, no vLLM
        preflight(["--calib", str(path), "--orca-audit-rate", "1.0", flag, value])
    assert "contradicts" in str(e.value) and "\n" not in str(e.value)


def test_an_empty_suffix_flag_is_refused(tmp_path):
    with pytest.raises(StartupError, match="--orca-audit-suffix is empty"):
        preflight(["--calib", str(_labelled(tmp_path, None)), "--orca-audit-rate", "1.0",
                   "--orca-audit-suffix", ""])


def test_the_block_is_written_only_when_it_differs_from_the_defaults(tmp_path):
    """A default-labelled bundle has no key (an older, strict reader reads it and audits it
    right); another labelling has it (such a reader refuses the unknown key)."""
    plain = tmp_path / "plain.json"
    save_bundle(small_bundle(), plain)
    for labelling in (None, Labelling()):
        path = _labelled(tmp_path, labelling)
        data = json.loads(path.read_text())
        assert "labelling" not in data
        assert data["checksum"] == json.loads(plain.read_text())["checksum"]
    data = json.loads(_labelled(tmp_path, THEIRS).read_text())
    assert data["labelling"] == {"suffix": THEIRS.suffix, "answer_tokens": 5}


def test_the_shipped_demo_bundles_carry_their_jobs_labelling():
    """Each demo bundle names the job that made it (a file of this checkout: a user reads the
    provenance to rebuild it), and carries that job's labelling and the conditions its collect
    ran under (the engine's dtype, the sampling: what orca-serve --demo serves and compares)."""
    import yaml

    from orca_calibrate.collect import ENGINE_DTYPE
    from orca_method.bundle import Generation

    root = Path(__file__).parents[1]
    for bundle in ("orca_serve/demo/bundle.json", "orca_serve/demo/long/bundle.json"):
        b = load_bundle(root / bundle)
        job = root / b.provenance["job"]
        assert job.is_file(), f"{bundle}: its provenance names {job}, not a file"
        collect = yaml.safe_load(job.read_text())["collect"]
        assert b.labelling == Labelling(
            suffix=collect["suffix"], answer_tokens=collect["answer_tokens"]), bundle
        assert b.collected_under() == Generation(
            dtype=collect.get("engine", {}).get("dtype", ENGINE_DTYPE),
            temperature=collect.get("temperature", CollectSettings.temperature),
            top_p=collect.get("top_p", CollectSettings.top_p),
            top_k=collect.get("top_k", CollectSettings.top_k),
            min_p=collect.get("min_p", CollectSettings.min_p)), bundle


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> Path:
    """A set recorded as collect records its labelling, calibrated into a bundle."""
    root = tmp_path_factory.mktemp("labelling")
    data = generate(root / "data", n_problems=300, dim=16, mean_steps=12, splits=(0.5, 0.5, 0.0))
    info = json.loads((data / "info.json").read_text())
    info["labelling"] = CollectSettings(suffix=THEIRS.suffix, answer_tokens=5).probe().labelling()
    (data / "info.json").write_text(json.dumps(info))
    probe = train_static(TrajectorySet.open(data), "consistent", seed=0)
    save_probe(probe, root / "p.safetensors", {"label_mode": "consistent", "seed": "0"})
    assert main(["calibrate", "--data", str(data), "--probe", str(root / "p.safetensors"),
                 "--out", str(root / "bundle.json"), "--delta", "0.1", "0.2"]) == 0
    return root


def test_collect_info_round_trips_into_the_bundle(collected):
    assert load_bundle(collected / "bundle.json").labelling == THEIRS


def test_offline_tools_read_only_audits_labelled_as_the_bundle_says(collected, tmp_path, capsys):
    """audit-report and recalibrate: audits labelled otherwise than the bundle's block are
    another risk (refused); the recalibrated bundle records the audits' labelling."""
    bundle = load_bundle(collected / "bundle.json")
    audits = generate(tmp_path / "audits", n_problems=20, dim=16, mean_steps=12, seed=1,
                      splits=None)
    info = json.loads((audits / "info.json").read_text())
    info["labelling"] = load_bundle(collected / "bundle.json").labelling.model_dump()
    (audits / "info.json").write_text(json.dumps(info))  # labelled as the bundle says
    assert open_audits(audits, bundle).info["labelling"] == THEIRS.model_dump()
    other = tmp_path / "other"
    generate(other, n_problems=20, dim=16, mean_steps=12, splits=None)
    info = json.loads((other / "info.json").read_text())
    info["labelling"] = Labelling(suffix="x{", answer_tokens=5).model_dump()
    (other / "info.json").write_text(json.dumps(info))
    with pytest.raises(BundleError, match="the audits' labelling suffix 'x\\{' contradicts"):
        open_audits(other, bundle)
    assert main(["audit-report", "--audit", str(other), "--bundle",
                 str(collected / "bundle.json")]) == 2
    assert "contradicts" in capsys.readouterr().err
    out = tmp_path / "new.json"
    assert main(["recalibrate", "--audit", str(audits), "--bundle",
                 str(collected / "bundle.json"), "--out", str(out), "--force"]) == 0
    assert load_bundle(out).labelling == THEIRS


def test_the_audit_directory_records_how_it_labelled(tmp_path):
    bundle = load_bundle(_labelled(tmp_path, THEIRS))
    config = audit_config(_options(), bundle)
    assert store_info(bundle, config.probe)["labelling"] == THEIRS.model_dump()
