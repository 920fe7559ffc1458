"""The per-request shift gate (orca_method/shift_gate.py): its conformal guarantee, tested by
repeated simulation, its power on a shifted population, the bundle block, and the bank's use."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from orca_method.bundle import BundleError, _checksum, gate_reference, load_bundle, save_bundle
from orca_method.probe import Probe, ProbeSpec
from orca_method.procedure import GateStep, ProbeBank
from orca_method.shift_gate import ShiftGate, fit_gate, gate_features, pvalue, threshold
from orca_method.thresholds import GIVE_UP_NEVER, NEVER

D = 32


def _population(rng: np.random.Generator, n: int, shift: float = 0.0) -> np.ndarray:
    """Features with a low-rank structure (as step embeddings have); `shift` moves the mean
    along a direction the training data barely varies in."""
    basis = np.linspace(0.5, 1.5, D * 4).reshape(4, D)
    x = rng.normal(size=(n, 4)) @ basis + 0.1 * rng.normal(size=(n, D))
    x[:, -1] += shift
    return x


def test_threshold_and_pvalue_agree_on_every_score():
    scores = sorted(np.random.default_rng(0).normal(size=99).tolist())
    for alpha in (0.01, 0.05, 0.1, 0.5):
        t = threshold(scores, alpha)
        for s in np.linspace(-4, 4, 401):
            assert (pvalue(scores, s) <= alpha) == (s > t), (alpha, s)
    assert threshold(scores, 0.005) == math.inf  # alpha < 1 / (n + 1): never flags


def test_in_distribution_flag_rate_is_at_most_alpha():
    """Marginal over calibration draws: P(flag) <= alpha, and close to it (the conformal bound is
    tight up to 1 / (n + 1)). 400 repetitions of (fit 200, calibrate 100, test 50), seed 0:
    the mean flag rate's standard error is ~0.0015, so the tolerance 0.006 is 4 of them."""
    rng = np.random.default_rng(0)
    alpha, rates = 0.1, []
    for _ in range(400):
        tensors, scores = fit_gate(_population(rng, 200), _population(rng, 100))
        gate = ShiftGate({k: torch.from_numpy(v) for k, v in tensors.items()}, scores, 1, alpha)
        s = gate.score(torch.from_numpy(_population(rng, 50)))
        rates.append(float((s > gate.threshold(alpha)).float().mean()))
    mean = float(np.mean(rates))
    assert mean <= alpha + 0.006
    assert mean >= alpha - 1 / 101 - 0.006


def test_a_shifted_population_is_flagged():
    rng = np.random.default_rng(1)
    tensors, scores = fit_gate(_population(rng, 300), _population(rng, 200))
    gate = ShiftGate({k: torch.from_numpy(v) for k, v in tensors.items()}, scores, 1, 0.05)
    s = gate.score(torch.from_numpy(_population(rng, 200, shift=1.0)))
    assert float((s > gate.threshold(0.05)).float().mean()) > 0.95


def test_gate_features_need_one_step_past_the_gate():
    e = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert np.allclose(gate_features(e, 2), e[:2].mean(0))
    assert gate_features(e, 3) is None  # the server never scores the last step


def _bank(gate: ShiftGate, gate_lam: float = NEVER, give_up: bool = False) -> ProbeBank:
    torch.manual_seed(0)
    return ProbeBank(Probe(ProbeSpec(dim=D)), window=1, capacity=4, gate=gate, gate_lam=gate_lam,
                     give_up=(Probe(ProbeSpec(dim=D, online=False)), 1) if give_up else None)


def _gate(steps: int) -> ShiftGate:
    rng = np.random.default_rng(2)
    tensors, scores = fit_gate(_population(rng, 300), _population(rng, 200))
    return ShiftGate({k: torch.from_numpy(v) for k, v in tensors.items()}, scores, steps, 0.05)


def _step(positions: list[int], decide: list[int], thr: float) -> GateStep:
    return GateStep(torch.tensor(positions, dtype=torch.long),
                    torch.tensor(decide, dtype=torch.long), torch.full((len(decide),), thr))


def test_bank_flags_at_the_gate_step_and_serves_the_safe_lambda():
    """Row 0 in distribution, row 1 shifted; both would stop at once (lambda 0). The gate sums
    their first two steps (the caller holds them at step 1), then flags row 1 only, which runs
    with the safe lambda (never) from that step on."""
    gate = _gate(steps=2)
    bank = _bank(gate)
    rng = np.random.default_rng(3)
    phi = torch.from_numpy(np.stack([_population(rng, 1)[0], _population(rng, 1, 3.0)[0]])).float()
    thr = gate.threshold(0.05)
    first = bank.step([0, 1], phi, torch.full((2,), NEVER), gate=_step([0, 1], [], thr))
    assert not first.stop.any() and first.gate_flag.numel() == 0
    second = bank.step([0, 1], phi, torch.zeros(2), gate=_step([0, 1], [0, 1], thr))
    assert second.gate_flag.tolist() == [False, True]
    assert second.stop.tolist() == [True, False]
    # the gate's features: the mean of the two steps, here the step itself
    assert second.gate_score.tolist() == pytest.approx(gate.score(phi).tolist(), rel=1e-5)
    # a row the gate does not work on is neither flagged nor changed
    bank.reset(1)
    off = bank.step([1], phi[1:], torch.zeros(1), gate=_step([], [], thr))
    assert off.stop.tolist() == [True] and off.gate_flag.numel() == 0


def test_a_flagged_row_never_gives_up():
    gate = _gate(steps=1)
    rng = np.random.default_rng(4)
    phi = torch.from_numpy(_population(rng, 2, 3.0)).float()
    never = torch.full((2,), NEVER)
    res = _bank(gate, give_up=True).step([0, 1], phi, never, mu=torch.ones(2),
                                         gate=_step([0, 1], [0, 1], gate.threshold(0.05)))
    assert res.gate_flag.all() and not res.give_up.any()
    unflagged = _bank(gate, give_up=True).step([0, 1], phi, never, mu=torch.ones(2))
    assert unflagged.give_up.all() and unflagged.gate_flag is None
    assert GIVE_UP_NEVER < 0


def test_bundle_carries_the_gate_and_refuses_a_damaged_one(tmp_path, bundle_path):
    bundle = load_bundle(bundle_path)
    rng = np.random.default_rng(5)
    d = bundle.model.hidden_size
    fit, cal = rng.normal(size=(60, d)), rng.normal(size=(40, d))
    ref = gate_reference(fit, cal, steps=1, alpha=0.05, rank=4)
    path = tmp_path / "gated.json"
    sealed = save_bundle(bundle.model_copy(update={"shift_gate": ref}), path)
    again = load_bundle(path)
    assert again.checksum == sealed.checksum
    gate = again.load_gate()
    assert gate is not None and gate.basis.shape == (4, d) and len(gate.scores) == 40
    assert again.summary()["shift_gate"] == {"steps": 1, "alpha": 0.05, "n_fit": 60, "n_cal": 40}
    # a bundle without a gate is written without the key, so its checksum is unchanged
    assert "shift_gate" not in json.loads(bundle_path.read_text())
    assert load_bundle(bundle_path).load_gate() is None
    # damaged: unsorted scores, tensors of another width
    for damage in ({"scores": ref.scores[::-1]},
                   {"tensors": gate_reference(rng.normal(size=(9, d + 1)),
                                              rng.normal(size=(5, d + 1)), steps=1,
                                              alpha=0.05).tensors}):
        data = json.loads(path.read_text())
        data["shift_gate"].update(damage)
        bad = tmp_path / "bad.json"
        data["checksum"] = _checksum(data)
        bad.write_text(json.dumps(data))
        with pytest.raises(BundleError, match="shift gate"):
            load_bundle(bad)


@pytest.mark.parametrize("folder, steps", [("", 1), ("long", 2)])
def test_the_demo_bundles_carry_a_gate(folder, steps):
    """Both shipped bundles are gated (orca-serve --demo serves with the gate on), each scored
    on a few hundred in-distribution prompts: enough for a p-value of 1/300."""
    from pathlib import Path

    import orca_serve

    path = Path(orca_serve.__file__).parent / "demo" / folder / "bundle.json"
    bundle = load_bundle(path)
    gate = bundle.load_gate()
    assert gate is not None and gate.steps == steps and len(gate.scores) >= 250
    assert gate.threshold(gate.alpha) < math.inf
