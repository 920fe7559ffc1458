"""`orca-calibrate import-probe`: the authors' released probe.pt + lambdas.json as a bundle.

The probe files are made by `tests/authors_format.py` in their format; the reference scores come
from an independent re-derivation of their probe (autograd, float64), not from our probe code.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from orca_calibrate.calibrate_cli import main as calibrate_main
from orca_method.bundle import load_bundle
from orca_method.procedure import replay
from tests.authors_format import (
    AuthorsProbe,
    authors_alignment,
    authors_pickle,
    authors_state_dict,
    smooth,
)

DIM, D_H = 24, 8
LAMBDAS = {"0.05": 0.9731, "0.1": 0.8125, "0.2": 0.5}
# (their config flags, their state-dict options, our variant name)
VARIANTS = [
    ({"no_kq": True}, {"no_kq": True}, "noqk"),
    ({"d_hidden": D_H}, {"no_kq": False}, f"qk{D_H}"),
    ({"d_hidden": D_H, "share_kq": True}, {"no_kq": False, "share_kq": True}, f"qk{D_H}-shared"),
    ({"d_hidden": D_H, "use_ln": True}, {"no_kq": False, "use_ln": True}, f"qk{D_H}-ln"),
    ({"d_hidden": D_H, "use_ln": True, "use_residual": True}, {"no_kq": False, "use_ln": True},
     f"qk{D_H}-ln_res"),
    ({"d_hidden": D_H, "learnable_eta": True, "base_lr": 0.2},
     {"no_kq": False, "learnable_eta": True}, f"qk{D_H}-eta-input"),
    ({"d_hidden": D_H, "use_mlp": True}, {"no_kq": False, "use_mlp": True}, f"qk{D_H}-mlp"),
]


def _write_release(tmp_path, flags: dict, sd_opts: dict, *, config: bool = True, seed: int = 0):
    """A released probe directory: probe.pt, lambdas.json and (optionally) config.json."""
    d = tmp_path / "probe"
    d.mkdir(exist_ok=True)
    sd = authors_state_dict(DIM, d_hidden=D_H, seed=seed, **sd_opts)
    torch.save(sd, d / "probe.pt")
    (d / "lambdas.json").write_text(json.dumps(LAMBDAS))
    if config:
        cfg = {"method": "ttt", "d_hidden": 128, "base_lr": 0.01, "smooth_window": 4,
               "label_mode": "consistent", "batch_size": 10, "no_kq": False, "use_ln": False,
               "use_residual": False, "share_kq": False, "use_mlp": False,
               "learnable_eta": False, "use_pca": False, **flags}
        (d / "config.json").write_text(json.dumps(cfg))
    return d, sd


def _import(d, *extra: str) -> int:
    return calibrate_main(["import-probe", str(d / "probe.pt"), "--lambdas",
                           str(d / "lambdas.json"), "--model", "authors/model", "--out",
                           str(d / "bundle.json"), *extra])


@pytest.mark.parametrize("flags,sd_opts,name", VARIANTS, ids=[v[2] for v in VARIANTS])
def test_imported_probe_scores_like_theirs(tmp_path, flags, sd_opts, name):
    d, sd = _write_release(tmp_path, flags, sd_opts)
    assert _import(d) == 0
    bundle = load_bundle(d / "bundle.json")
    assert bundle.spec().name == name and bundle.window == 4 and bundle.label_mode == "consistent"
    theirs = AuthorsProbe(sd, use_ln=flags.get("use_ln", False),
                          use_residual=flags.get("use_residual", False),
                          base_lr=flags.get("base_lr", 0.01))
    # their trajectories, aligned as their calibration loop aligns them
    pkl = authors_pickle(seed=1, n_problems=6, dim=DIM)
    trajs = [authors_alignment(p)[0] / 3 for p in pkl["problems"]]
    ours = replay(bundle.load_probe(), trajs, bundle.window)
    for traj, (raw, sm) in zip(trajs, ours):
        ref = theirs.scores(traj)
        assert max(np.ptp(ref), 0) > 1e-3  # the scores move: the online update is exercised
        np.testing.assert_allclose(raw.numpy(), ref, atol=2e-5, rtol=0)
        np.testing.assert_allclose(sm.numpy(), smooth(ref, bundle.window), atol=2e-5, rtol=0)


def test_bundle_carries_their_serving_settings(tmp_path, capsys):
    d, _ = _write_release(tmp_path, {"d_hidden": D_H}, {"no_kq": False})
    assert _import(d, "--default-delta", "0.2") == 0
    assert "off-policy" in capsys.readouterr().out
    b = load_bundle(d / "bundle.json")
    seg = b.segmentation
    assert (seg.delimiter, seg.keywords, seg.keyword_match, seg.max_step_tokens) == (
        "\n", ["wait", "Wait", "but", "But"], "substring", 500)
    assert b.normalization == "token-l2" and b.model.name == "authors/model"
    assert b.model.hidden_size == DIM and b.model.tokenizer_fingerprint is None
    assert {str(r.delta): r.lam for r in b.ltt.rows} == LAMBDAS
    assert all(r.risk is None and r.savings is None for r in b.ltt.rows) and b.ltt.n_cal is None
    assert b.default_delta == 0.2 and "authors' own calibration" in b.lambdas_from
    assert b.spec().ln_eps == 1e-6 and b.spec().gelu == "tanh"
    assert math.isclose(b.probe.eta, 0.05, rel_tol=1e-6)
    # without a config: structure from the keys, window 10, no length cut on request
    (d / "config.json").unlink()
    assert _import(d, "--max-step-tokens", "0", "--normalization", "none") == 0
    b = load_bundle(d / "bundle.json")
    assert b.window == 10 and b.segmentation.max_step_tokens is None and b.default_delta == 0.1
    assert b.normalization == "none"


def test_imported_probe_recalibrates_on_their_data(tmp_path, capsys):
    """--probe-out gives the probe to `calibrate`, here on a pickle in their release format."""
    import pickle

    d, _ = _write_release(tmp_path, {"d_hidden": D_H}, {"no_kq": False})
    assert _import(d, "--probe-out", str(d / "p.safetensors")) == 0
    (tmp_path / "data.pkl").write_bytes(pickle.dumps(authors_pickle(seed=2, n_problems=30,
                                                                    dim=DIM)))
    assert calibrate_main(["calibrate", "--data", str(tmp_path / "data.pkl"), "--pickle-labels",
                           "research", "--probe", str(d / "p.safetensors"), "--window", "4",
                           "--out", str(tmp_path / "own.json")]) == 0, capsys.readouterr().err
    own, imported = load_bundle(tmp_path / "own.json"), load_bundle(d / "bundle.json")
    assert own.label_mode == "consistent" and own.ltt.n_cal >= 1 and own.lambdas_from is None
    assert own.probe.weights == imported.probe.weights and own.spec() == imported.spec()


def test_shared_projection_is_detected_without_config(tmp_path):
    d, _ = _write_release(tmp_path, {}, {"no_kq": False, "share_kq": True}, config=False)
    assert _import(d) == 0
    assert load_bundle(d / "bundle.json").spec().name == f"qk{D_H}-shared"


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("case,match", [
    ("unknown_key", "unknown keys ['extra']"),
    ("pca", "PCA preprocessing"),
    ("ln_without_config", "use_residual tells ln from ln_res"),
    ("config_disagrees", "config.json says use_mlp=True but the state dict lacks W10"),
    ("bad_lambda", "lambda* for delta 0.1 must be a number in [0, 1]"),
    ("not_a_state_dict", "is not a PyTorch state dict"),
    ("bad_shape", "'b0' has shape (2,), expected (1,)"),
])
def test_refusals_are_one_line(tmp_path, capsys, case, match):
    flags, opts = {"no_kq": True}, {"no_kq": True}
    if case == "ln_without_config":
        opts["use_ln"] = True
    d, sd = _write_release(tmp_path, flags, opts, config=case != "ln_without_config")
    cfg = d / "config.json"
    if case == "unknown_key":
        torch.save({**sd, "extra": torch.zeros(1)}, d / "probe.pt")
    elif case == "pca":
        cfg.write_text(json.dumps({"no_kq": True, "use_pca": True}))
    elif case == "config_disagrees":
        cfg.write_text(json.dumps({"no_kq": True, "use_mlp": True}))
    elif case == "bad_lambda":
        (d / "lambdas.json").write_text(json.dumps({"0.1": 1.5}))
    elif case == "not_a_state_dict":
        (d / "probe.pt").write_bytes(b"\x80\x04not a pickle at all")
    elif case == "bad_shape":
        torch.save({**sd, "b0": torch.zeros(2)}, d / "probe.pt")
    assert _import(d) == 2
    line = _one_error_line(capsys)
    assert line.startswith("orca-calibrate import-probe: error:") and match in line, line


def test_orca_serve_states_where_lambdas_come_from(tmp_path, capsys):
    """The note is printed once at start, before the model check (which fails here: the
    "model" folder has a config but no tokenizer)."""
    from orca_serve.startup.cli import main as serve_main

    d, _ = _write_release(tmp_path, {"no_kq": True}, {"no_kq": True})
    assert _import(d) == 0
    capsys.readouterr()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": DIM}))
    with pytest.raises(SystemExit) as e:
        serve_main(["--model", str(model), "--calib", str(d / "bundle.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[1].startswith("orca-serve: error:")
    assert err[0].startswith("orca-serve: note: lambda* in ") and "off-policy" in err[0]


def test_an_imported_bundle_names_its_model_and_tokenizer(tmp_path, capsys, model, tok):
    """With --tokenizer (or a local --model) the bundle records the tokenizer's fingerprint;
    with a hub name only, none, and the import says orca-serve will refuse it unless forced."""
    from orca_method.bundle import tokenizer_fingerprint

    d, _ = _write_release(tmp_path, {"no_kq": True}, {"no_kq": True})
    assert _import(d, "--tokenizer", str(model)) == 0
    bundle = load_bundle(d / "bundle.json")
    assert bundle.model.name == "authors/model"
    assert bundle.model.tokenizer_fingerprint == tokenizer_fingerprint(tok.get_vocab())
    capsys.readouterr()
    assert _import(d) == 0
    assert load_bundle(d / "bundle.json").model.tokenizer_fingerprint is None
    assert "names no tokenizer" in capsys.readouterr().err
    assert _import(d, "--tokenizer", str(tmp_path / "nothing")) == 2
    assert "cannot load the tokenizer" in capsys.readouterr().err
