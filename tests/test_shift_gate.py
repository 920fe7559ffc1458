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
from orca_method.shift_gate import (
    DEFAULT_GATE_ALPHA,
    DEFAULT_GATE_GIVE_UP_ALPHA,
    ShiftGate,
    fit_gate,
    gate_features,
    pvalue,
    threshold,
)
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


@pytest.mark.parametrize("alpha, give_up_alpha", [(0.1, 0.1), (0.035, 0.05)])
def test_in_distribution_flag_rate_is_at_most_alpha(alpha, give_up_alpha):
    """Marginal over calibration draws: P(flag) <= alpha, and close to it (the conformal bound is
    tight up to 1 / (n + 1)); likewise the give-up side's bar at its own level, with the levels
    the demo bundles ship (0.035 / 0.05). 400 repetitions of (fit 200, calibrate 100, test 50),
    seed 0: the mean rate's standard error is ~0.0015 at 0.1 (~0.001 at 0.035), so the tolerance
    0.006 is 4 of them or more."""
    rng = np.random.default_rng(0)
    flagged, barred = [], []
    for _ in range(400):
        tensors, scores = fit_gate(_population(rng, 200), _population(rng, 100))
        gate = ShiftGate({k: torch.from_numpy(v) for k, v in tensors.items()}, scores, 1, alpha,
                         give_up_alpha=give_up_alpha)
        s = gate.score(torch.from_numpy(_population(rng, 50)))
        thr, thr_give_up = gate.thresholds()
        flagged.append(float((s > thr).float().mean()))
        barred.append(float((s > thr_give_up).float().mean()))
    for level, rates in ((alpha, flagged), (give_up_alpha, barred)):
        mean = float(np.mean(rates))
        # n = 100 scores: a level is met exactly at multiples of 1 / 101
        assert mean <= level + 0.006, (level, mean)
        assert mean >= math.floor(level * 101) / 101 - 0.006, (level, mean)


def test_levels_resolve_and_the_give_up_side_is_never_below_the_stop_side():
    gate = _gate(steps=1)  # the bundle's alpha 0.05, no give-up level: one level
    assert gate.levels() == (0.05, 0.05)
    two = ShiftGate({"mean": gate.mean, "basis": gate.basis, "var": gate.var,
                     "res_scale": torch.tensor([gate.res_scale])}, gate.scores, 1, 0.035,
                    give_up_alpha=0.05)
    assert two.levels() == (0.035, 0.05)
    assert two.levels(0.02) == (0.02, 0.05)  # a request's own stop level, the bundle's give-up
    assert two.levels(0.1) == (0.1, 0.1)  # a default give-up level is raised to the stop level
    assert two.levels(0.02, 0.2) == (0.02, 0.2)
    assert two.levels(0.0, 0.2) == (0.0, 0.0)  # alpha 0: no gate on either side
    thr, thr_give_up = two.thresholds()
    assert thr_give_up < thr  # the higher level flags more: its threshold is lower
    assert two.thresholds(0.0) == (math.inf, math.inf)
    with pytest.raises(ValueError, match="at least the stop side's"):
        ShiftGate({"mean": gate.mean, "basis": gate.basis, "var": gate.var,
                   "res_scale": torch.tensor([gate.res_scale])}, gate.scores, 1, 0.05,
                  give_up_alpha=0.035)


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


def _step(positions: list[int], decide: list[int], thr: float,
          thr_give_up: float | None = None) -> GateStep:
    """Both sides at `thr` unless the give-up side has its own threshold."""
    k = len(decide)
    return GateStep(torch.tensor(positions, dtype=torch.long),
                    torch.tensor(decide, dtype=torch.long), torch.full((k,), thr),
                    torch.full((k,), thr if thr_give_up is None else thr_give_up))


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


def test_a_row_barred_at_the_give_up_level_only_stops_but_never_gives_up():
    """Two levels, three rows: row 0 passes both (gives up), row 1's score lies between the
    give-up side's threshold and the stop side's (not flagged: it keeps its own lambda and may
    stop; barred: it never gives up), row 2 is above both (flagged, barred, the safe lambda).
    The thresholds are put between the rows' own scores, so each row is on the side named."""
    gate = _gate(steps=1)
    rng = np.random.default_rng(5)
    phi = torch.from_numpy(np.stack([_population(rng, 1)[0], _population(rng, 1, 2.0)[0],
                                     _population(rng, 1, 6.0)[0]])).float()
    s = sorted(gate.score(phi).tolist())
    assert s == gate.score(phi).tolist()  # the rows are in score order
    thr, thr_give_up = (s[1] + s[2]) / 2, (s[0] + s[1]) / 2
    never = torch.full((3,), NEVER)
    step = _step([0, 1, 2], [0, 1, 2], thr, thr_give_up)
    res = _bank(gate, give_up=True).step([0, 1, 2], phi, never, mu=torch.ones(3), gate=step)
    assert res.gate_flag.tolist() == [False, False, True]
    assert res.gate_barred.tolist() == [False, True, True]
    assert res.give_up.tolist() == [True, False, False]
    # the stop side: lambda 0 stops every row but the flagged one (safe lambda: never)
    res = _bank(gate, give_up=True).step([0, 1, 2], phi, torch.zeros(3), mu=torch.ones(3),
                                         gate=step)
    assert res.stop.tolist() == [True, True, False] and not res.give_up.any()
    # a flagged row is barred whatever give-up threshold the caller passes
    res = _bank(gate, give_up=True).step([0, 1, 2], phi, never, mu=torch.ones(3),
                                         gate=_step([0, 1, 2], [0, 1, 2], thr, math.inf))
    assert res.gate_barred.tolist() == [False, False, True]


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
    assert again.summary()["shift_gate"] == {"steps": 1, "alpha": 0.05, "give_up_alpha": 0.05,
                                             "n_fit": 60, "n_cal": 40}
    # a block without give_up_alpha (every bundle before it) is written without the key, and
    # means one level for both sides, as it did
    assert "give_up_alpha" not in json.loads(path.read_text())["shift_gate"]
    assert gate.levels() == (0.05, 0.05)
    # with one, it round-trips; below alpha it is refused
    two = save_bundle(bundle.model_copy(update={"shift_gate": ref.model_copy(
        update={"alpha": 0.035, "give_up_alpha": 0.05})}), tmp_path / "two.json")
    assert load_bundle(tmp_path / "two.json").load_gate().levels() == (0.035, 0.05)
    assert two.summary()["shift_gate"]["give_up_alpha"] == 0.05
    # a bundle without a gate is written without the key, so its checksum is unchanged
    assert "shift_gate" not in json.loads(bundle_path.read_text())
    assert load_bundle(bundle_path).load_gate() is None
    # damaged: unsorted scores, tensors of another width, a give-up level below alpha
    for damage in ({"scores": ref.scores[::-1]}, {"give_up_alpha": 0.01},
                   {"tensors": gate_reference(rng.normal(size=(9, d + 1)),
                                              rng.normal(size=(5, d + 1)), steps=1,
                                              alpha=0.05).tensors}):
        data = json.loads(path.read_text())
        data["shift_gate"].update(damage)
        bad = tmp_path / "bad.json"
        data["checksum"] = _checksum(data)
        bad.write_text(json.dumps(data))
        with pytest.raises(BundleError, match="shift gate|shift_gate"):
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
    # the job's default levels (benchmarks/RESULTS.md, "Shift replay")
    assert gate.levels() == (DEFAULT_GATE_ALPHA, DEFAULT_GATE_GIVE_UP_ALPHA) == (0.035, 0.05)
