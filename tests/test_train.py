"""Meta-training: the kernel-form unroll is the deployed procedure, and training learns."""

import numpy as np
import pytest
import torch

from orca_calibrate.synth import generate
from orca_calibrate.train import (
    load_probe,
    meta_train,
    save_probe,
    solvable,
    train_static,
    training_settings,
    unroll_scores,
)
from orca_method.probe import Probe, ProbeSpec
from orca_method.procedure import replay
from orca_method.trajectories import TrajectorySet

D = 16
KERNEL_VARIANTS = [
    ProbeSpec(dim=D),
    ProbeSpec(dim=D, kind="qk", d_h=6),
    ProbeSpec(dim=D, kind="qk", d_h=6, shared_qk=True),
    ProbeSpec(dim=D, eta_mode="input"),
    ProbeSpec(dim=D, online=False),
]


@pytest.mark.parametrize("spec", KERNEL_VARIANTS, ids=lambda s: s.name)
def test_kernel_unroll_equals_deployed_replay(spec: ProbeSpec) -> None:
    probe = Probe(spec, seed=1)
    with torch.no_grad():
        for p in probe.params.values():
            p.add_(0.3 * torch.randn_like(p))
        probe.params["log_eta"].fill_(0.0)  # eta = 1: large inner steps, so errors would show
    lengths = [9, 4, 13]
    trajs = [torch.randn(n, D) for n in lengths]
    phi = torch.nn.utils.rnn.pad_sequence(trajs, batch_first=True)
    mask = torch.arange(phi.shape[1])[None] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        fast = unroll_scores(probe, phi, mask)
    for i, (raw, _) in enumerate(replay(probe, trajs, window=3)):
        torch.testing.assert_close(fast[i, :lengths[i]], raw, rtol=1e-4, atol=1e-5)


def test_kernel_unroll_gradients_match_general_unroll() -> None:
    probe = Probe(ProbeSpec(dim=D, kind="qk", d_h=6, eta_mode="input"), seed=2).double()
    phi = torch.randn(3, 7, D, dtype=torch.float64)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 5:] = False
    g1 = torch.autograd.grad(unroll_scores(probe, phi, mask)[mask].sum(), list(probe.parameters()))
    g2 = torch.autograd.grad(probe.unroll(phi, mask)[mask].sum(), list(probe.parameters()))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> TrajectorySet:
    out = tmp_path_factory.mktemp("synth") / "data"
    generate(out, n_problems=300, dim=D, mean_steps=30, seed=0)
    return TrajectorySet.open(out)


def test_meta_training_reduces_loss_and_is_reproducible(synth: TrajectorySet, tmp_path) -> None:
    spec = ProbeSpec(dim=D)
    a = meta_train(synth, spec, "supervised", epochs=3, seed=5, progress=False,
                   checkpoints=tmp_path / "ckpt")
    b = meta_train(synth, spec, "supervised", epochs=3, seed=5, progress=False)
    assert a.history[-1]["train_loss"] < a.history[0]["train_loss"]
    assert [h["train_loss"] for h in a.history] == [h["train_loss"] for h in b.history]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "epoch_001.safetensors", "epoch_002.safetensors", "epoch_003.safetensors", "resume.pt"]
    save_probe(a.probe, tmp_path / "p.safetensors", {"epoch": a.epoch})
    loaded, meta = load_probe(tmp_path / "p.safetensors")
    assert loaded.spec == spec and meta["epoch"] == str(a.epoch)
    for k, v in a.probe.params.items():
        torch.testing.assert_close(loaded.params[k], v)


def test_static_probe_separates_labels(synth: TrajectorySet) -> None:
    probe = train_static(synth, "supervised", pca_dim=8)
    test = solvable(synth, synth.split("test"), "supervised")
    raw = [r.numpy() for r, _ in replay(probe, [synth.embeddings(i) for i in test], window=1)]
    s = np.concatenate(raw)
    y = np.concatenate([synth.labels(i, "supervised") for i in test])
    assert s[y == 1].mean() > s[y == 0].mean() + 0.1


def test_cached_gram_gives_the_same_scores() -> None:
    probe = Probe(ProbeSpec(dim=D), seed=3)
    phi = torch.randn(2, 6, D)
    mask = torch.ones(2, 6, dtype=torch.bool)
    gram = phi @ phi.transpose(1, 2)
    with torch.no_grad():
        torch.testing.assert_close(unroll_scores(probe, phi, mask, gram),
                                   unroll_scores(probe, phi, mask))


def test_epoch_select_last_keeps_the_last_epoch_and_all_problems(synth: TrajectorySet,
                                                                   tmp_path) -> None:
    res = meta_train(synth, ProbeSpec(dim=D), "supervised", epochs=3, seed=1, progress=False,
                     epoch_select="last", checkpoints=tmp_path)
    assert res.epoch == 3 and [h["epoch"] for h in res.history] == [1, 2, 3]
    assert all("val_savings" not in h for h in res.history)  # no validation part held out
    last, _ = load_probe(tmp_path / "epoch_003.safetensors")
    for k, v in res.probe.params.items():
        torch.testing.assert_close(last.params[k], v)
    val = meta_train(synth, ProbeSpec(dim=D), "supervised", epochs=3, seed=1, progress=False,
                     epoch_select="validation")
    assert 1 <= val.epoch <= 3 and all("val_savings" in h for h in val.history)


def test_warmup_starts_slow(synth: TrajectorySet) -> None:
    """With warmup the first optimizer steps are smaller, so slow weights move less."""
    moved = {}
    for warmup in (0.0, 0.5):
        res = meta_train(synth, ProbeSpec(dim=D), "supervised", epochs=1, seed=2, lr=0.05,
                         warmup=warmup, progress=False, epoch_select="last")
        moved[warmup] = (res.probe.params["w"] - Probe(ProbeSpec(dim=D), seed=2).params["w"]).norm()
    assert moved[0.5] < moved[0.0]


@pytest.mark.parametrize("bad", [{"epoch_select": "best"}, {"warmup": 1.0}, {"lr": 0.0},
                                 {"batch_size": 0}])
def test_bad_training_settings_are_refused(synth: TrajectorySet, bad: dict) -> None:
    with pytest.raises(ValueError):
        meta_train(synth, ProbeSpec(dim=D), "supervised", progress=False, **{"epochs": 1, **bad})


def test_an_lr_the_batch_rule_derives_is_named_as_such(synth: TrajectorySet) -> None:
    """The user set a batch size, not an lr: the refusal says the rule gave it."""
    with pytest.raises(ValueError, match=r"^lr is not set, and batch_size 40000 gives 1.17 "):
        meta_train(synth, ProbeSpec(dim=D), "supervised", progress=False, batch_size=40000)
    with pytest.raises(ValueError, match=r"^lr is not set"):
        training_settings(ProbeSpec(dim=D), {"batch_size": 40000})


def test_cli_training_options(synth: TrajectorySet, tmp_path, capsys) -> None:
    from orca_calibrate.calibrate_cli import main
    out = tmp_path / "p.safetensors"
    assert main(["train", "--data", str(synth.path), "--out", str(out), "--epochs", "2",
                 "--epoch-select", "last", "--batch-size", "8", "--lr", "0.004"]) == 0
    _, meta = load_probe(out)
    assert (meta["selected_epoch"], meta["batch_size"], meta["lr"]) == ("2", "8", "0.004")
    assert meta["epoch_select"] == "last"
    # a bad choice is the CLI's one-line error, exit code 2 (not argparse's SystemExit)
    assert main(["train", "--data", str(synth.path), "--out", str(out),
                 "--epoch-select", "best"]) == 2


def test_default_learning_rate_follows_the_batch_size() -> None:
    from orca_calibrate.train_defaults import DEFAULTS, PAPER_LR, lr_for_batch
    assert lr_for_batch(1) == PAPER_LR  # batch 1 keeps the paper's setting
    assert lr_for_batch(32) == pytest.approx(1.008e-2, rel=1e-3)
    assert DEFAULTS["lr"] is None and DEFAULTS["epoch_select"] == "last"


class Killed(Exception):
    """Stands for a kill in the middle of an epoch."""


def _kill_in_epoch(monkeypatch, epoch: int) -> None:
    """The run dies after training `epoch`'s batches, before that epoch is saved."""
    calls = iter(range(1, 100))
    real = Probe.check_finite

    def check(self) -> None:
        if next(calls) == epoch:
            raise Killed
        real(self)
    monkeypatch.setattr(Probe, "check_finite", check)


@pytest.mark.parametrize("select", ["last", "validation"])
def test_a_killed_training_resumes_to_the_uninterrupted_probe(synth: TrajectorySet, tmp_path,
                                                              monkeypatch, select: str) -> None:
    kw = dict(epochs=4, seed=3, progress=False, epoch_select=select)
    whole = meta_train(synth, ProbeSpec(dim=D), "supervised", checkpoints=tmp_path / "a", **kw)
    with monkeypatch.context() as m:
        _kill_in_epoch(m, 3)
        with pytest.raises(Killed):
            meta_train(synth, ProbeSpec(dim=D), "supervised", checkpoints=tmp_path / "b", **kw)
    assert sorted(p.name for p in (tmp_path / "b").glob("epoch_*")) == [
        "epoch_001.safetensors", "epoch_002.safetensors"]
    resumed = meta_train(synth, ProbeSpec(dim=D), "supervised", checkpoints=tmp_path / "b", **kw)
    assert resumed.epoch == whole.epoch
    for k, v in whole.probe.params.items():
        assert torch.equal(resumed.probe.params[k], v), k
    strip = [{k: v for k, v in h.items() if "seconds" not in k} for h in whole.history]
    assert [{k: v for k, v in h.items() if "seconds" not in k} for h in resumed.history] == strip
    seconds = [h["seconds"] for h in resumed.history]
    assert seconds == sorted(seconds)  # counted from the first epoch, across the resume


def test_checkpoints_of_other_settings_are_cleared_not_resumed(synth: TrajectorySet, tmp_path,
                                                               capsys) -> None:
    ckpt = tmp_path / "ckpt"
    first = meta_train(synth, ProbeSpec(dim=D), "supervised", epochs=3, seed=3, progress=False,
                       checkpoints=ckpt)
    again = meta_train(synth, ProbeSpec(dim=D), "supervised", epochs=3, seed=3, progress=False,
                       checkpoints=ckpt)  # done already: nothing left to train
    assert "resuming after epoch 3" in capsys.readouterr().err
    assert again.history == first.history
    other = meta_train(synth, ProbeSpec(dim=D), "supervised", epochs=2, seed=3, lr=0.02,
                       progress=False, checkpoints=ckpt)
    assert "removed 4 checkpoint file(s)" in capsys.readouterr().err
    assert [h["epoch"] for h in other.history] == [1, 2]
    assert sorted(p.name for p in ckpt.glob("epoch_*")) == [
        "epoch_001.safetensors", "epoch_002.safetensors"]
    (ckpt / "resume.pt").write_bytes(b"not a checkpoint")  # unreadable: stale, never fatal
    assert meta_train(synth, ProbeSpec(dim=D), "supervised", epochs=2, seed=3, lr=0.02,
                      progress=False, checkpoints=ckpt).history[0]["epoch"] == 1
