"""The bundle refuses everything that would make the server compute something else."""

import base64
import hashlib
import json

import pytest
import torch
from safetensors.torch import save as st_save

from orca_serve.bundle import (
    Bundle,
    BundleError,
    LTTRow,
    LTTTable,
    ModelIdentity,
    ProbeBlock,
    _checksum,
    check_model,
    encode_weights,
    load_bundle,
    save_bundle,
    tokenizer_fingerprint,
)
from orca_serve.probe import Probe, ProbeSpec

VOCAB = {"a": 0, "b": 1, "<think>": 2, "</think>": 3}


def make_bundle(dim: int = 8, spec: ProbeSpec | None = None) -> Bundle:
    probe = Probe(spec or ProbeSpec(dim=dim), seed=0)
    return Bundle(
        schema_version=1, orca_serve_version="0.1.0",
        model=ModelIdentity(name="tiny", hidden_size=dim,
                            tokenizer_fingerprint=tokenizer_fingerprint(VOCAB)),
        probe=ProbeBlock(spec=json.loads(probe.spec.to_json()), weights=encode_weights(probe),
                         eta=0.01),
        ltt=LTTTable(epsilon=0.05, n_cal=100, grid_size=1001, rows=[
            LTTRow(delta=0.05, lam=None, risk=0.0, pvalue=1.0, savings=0.0),
            LTTRow(delta=0.1, lam=0.8, risk=0.04, pvalue=0.01, savings=0.3)]),
        default_delta=0.1)


def _rewrite(path, mutate) -> None:
    """Edit a saved bundle and re-seal it, so only the edited property is wrong."""
    data = json.loads(path.read_text())
    mutate(data)
    data["checksum"] = _checksum(data)
    path.write_text(json.dumps(data))


def test_roundtrip_and_lookup(tmp_path) -> None:
    b = save_bundle(make_bundle(), tmp_path / "b.json")
    loaded = load_bundle(tmp_path / "b.json")
    assert loaded == b
    assert loaded.lam(0.1) == 0.8 and loaded.lam(0.05) == float("inf")
    probe = loaded.load_probe()
    assert probe.spec == ProbeSpec(dim=8)
    assert "weights" not in json.dumps(loaded.summary())


def test_every_variant_roundtrips(tmp_path) -> None:
    spec = ProbeSpec(dim=8, kind="qk", d_h=4, norm="ln", eta_mode="input")
    save_bundle(make_bundle(spec=spec), tmp_path / "b.json")
    probe = load_bundle(tmp_path / "b.json").load_probe()
    ref = Probe(spec, seed=0)
    for k, v in ref.params.items():
        torch.testing.assert_close(probe.params[k], v.detach())


def test_delta_not_in_table_lists_available(tmp_path) -> None:
    b = save_bundle(make_bundle(), tmp_path / "b.json")
    with pytest.raises(BundleError, match="available deltas: 0.05, 0.1"):
        b.lam(0.2)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema_version=2), "schema version 2"),
    (lambda d: d["ltt"].update(rows=[]), "empty LTT table"),
    (lambda d: d.update(default_delta=0.3), "delta 0.3 has no calibrated"),
    (lambda d: d["model"].update(hidden_size=16), "probe dim 8 != model hidden size 16"),
    (lambda d: d["ltt"].update(epsilon=2), "ltt.epsilon"),
    (lambda d: d.update(extra_field=1), "extra_field"),
])
def test_invalid_bundles_are_refused(tmp_path, mutate, message) -> None:
    save_bundle(make_bundle(), tmp_path / "b.json")
    _rewrite(tmp_path / "b.json", mutate)
    with pytest.raises(BundleError, match=message):
        load_bundle(tmp_path / "b.json")


def test_checksum_mismatch(tmp_path) -> None:
    save_bundle(make_bundle(), tmp_path / "b.json")
    data = json.loads((tmp_path / "b.json").read_text())
    data["window"] = 3
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="checksum"):
        load_bundle(tmp_path / "b.json")


@pytest.mark.parametrize("tensors, message", [
    ({"w": torch.full((8,), float("nan")), "b": torch.zeros(()), "log_eta": torch.zeros(())},
     "NaN or inf"),
    ({"w": torch.zeros(9), "b": torch.zeros(()), "log_eta": torch.zeros(())}, "shape"),
    ({"w": torch.zeros(8), "log_eta": torch.zeros(())}, "do not match"),
])
def test_bad_weights(tmp_path, tensors, message) -> None:
    save_bundle(make_bundle(), tmp_path / "b.json")
    blob = base64.b64encode(st_save(tensors)).decode()
    _rewrite(tmp_path / "b.json", lambda d: d["probe"].update(weights=blob))
    with pytest.raises(BundleError, match=message):
        load_bundle(tmp_path / "b.json")


def test_not_a_bundle(tmp_path) -> None:
    with pytest.raises(BundleError, match="not found"):
        load_bundle(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{oops")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle(tmp_path / "x.json")


def test_check_model() -> None:
    b = make_bundle()
    check_model(b, 8, VOCAB, "tiny")
    with pytest.raises(BundleError, match="hidden size 16"):
        check_model(b, 16, VOCAB, "other")
    with pytest.raises(BundleError, match="tokenizer"):
        check_model(b, 8, {**VOCAB, "c": 4}, "other")
    assert tokenizer_fingerprint(VOCAB) == hashlib.sha256(
        json.dumps(sorted(VOCAB.items(), key=lambda kv: kv[1])).encode()).hexdigest()
