"""The probe's closed-form inner step, batching and reset (docs/METHOD.md section 2)."""

import pytest
import torch

from orca_method.probe import Probe, ProbeSpec
from orca_method.procedure import ProbeBank, finish_step, normalize_tokens, replay
from orca_method.thresholds import NEVER

D = 24
VARIANTS = [
    ProbeSpec(dim=D),
    ProbeSpec(dim=D, kind="qk", d_h=8),
    ProbeSpec(dim=D, kind="qk", d_h=8, shared_qk=True),
    ProbeSpec(dim=D, kind="qk", d_h=8, norm="ln"),
    ProbeSpec(dim=D, kind="qk", d_h=8, norm="ln_res"),
    ProbeSpec(dim=D, norm="ln"),
    ProbeSpec(dim=D, eta_mode="input"),
    ProbeSpec(dim=D, kind="qk", d_h=8, mlp=True),
    ProbeSpec(dim=D, kind="qk", d_h=6, shared_qk=True, norm="ln_res", eta_mode="input"),
    ProbeSpec(dim=D, kind="qk", d_h=8, norm="ln", ln_eps=1e-6),
    ProbeSpec(dim=D, mlp=True, gelu="tanh"),
]


def _perturbed(spec: ProbeSpec, seed: int = 0) -> Probe:
    """A probe whose slow weights are all non-trivial (LN gamma != 1, biases != 0)."""
    probe = Probe(spec, seed=seed).double()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in probe.params.values():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return probe


def _inner_loss(probe: Probe, fast: dict, u: torch.Tensor, target: float) -> torch.Tensor:
    """The inner loss written the obvious way, for autograd to differentiate."""
    spec = probe.spec
    if spec.mlp:
        a = torch.einsum("nhd,nd->nh", fast["w1"], u) + fast["b1"]
        gelu = torch.nn.functional.gelu(a, approximate="tanh" if spec.gelu == "tanh" else "none")
        z = (fast["w2"] * gelu).sum(-1) + fast["b2"]
    else:
        x = fast["w"] * u
        if spec.norm == "none":
            z = x.sum(-1) + fast["b"]
        else:
            ln = torch.nn.functional.layer_norm(x, (x.shape[-1],), probe.params["ln_gamma"],
                                                probe.params["ln_beta"], eps=spec.ln_eps)
            z = ln.sum(-1) + fast["b"] + (x.sum(-1) if spec.norm == "ln_res" else 0)
    return ((torch.sigmoid(z) - target) ** 2).sum()


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
@pytest.mark.parametrize("target", [0.0, 1.0])
def test_closed_form_inner_gradient_equals_autograd(spec: ProbeSpec, target: float) -> None:
    probe = _perturbed(spec)
    n = 5
    fast = {k: v + 0.5 * torch.randn_like(v) for k, v in probe.init_fast(n).items()}
    phi = torch.randn(n, D, dtype=torch.float64) * 2
    u = probe.key(phi).detach()
    _, grads = probe.inner_grads(fast, u, target)
    leaves = {k: v.detach().requires_grad_() for k, v in fast.items()}
    auto = torch.autograd.grad(_inner_loss(probe, leaves, u, target), list(leaves.values()))
    for (k, _), a in zip(leaves.items(), auto):
        torch.testing.assert_close(grads[k], a, rtol=1e-9, atol=1e-12, msg=f"grad of {k}")


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_bank_batched_equals_one_request_at_a_time(spec: ProbeSpec) -> None:
    probe = _perturbed(spec).float()
    gen = torch.Generator().manual_seed(3)
    trajs = [torch.randn(int(t), D, generator=gen) for t in torch.randint(3, 30, (7,), generator=gen)]
    batched = replay(probe, trajs, window=4, batch=7)
    for traj, (raw, smooth) in zip(trajs, batched):
        [(raw1, smooth1)] = replay(probe, [traj], window=4, batch=1)
        torch.testing.assert_close(raw, raw1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(smooth, smooth1, rtol=1e-5, atol=1e-6)


def test_bank_matches_unroll_and_trailing_mean() -> None:
    """The server's step, the training unroll and a plain trailing mean agree."""
    probe = _perturbed(ProbeSpec(dim=D, kind="qk", d_h=8, norm="ln")).float()
    traj = torch.randn(25, D)
    [(raw, smooth)] = replay(probe, [traj], window=5)
    with torch.no_grad():
        unrolled = probe.unroll(traj[None], torch.ones(1, 25, dtype=torch.bool))[0]
    torch.testing.assert_close(raw, unrolled)
    expected = torch.stack([raw[max(0, t - 4):t + 1].mean() for t in range(25)])
    torch.testing.assert_close(smooth, expected)


def test_reset_is_exact_and_rows_are_independent() -> None:
    probe = _perturbed(ProbeSpec(dim=D)).float()
    bank = ProbeBank(probe, window=3, capacity=2)
    a, b = 0, 1
    xs = torch.randn(6, D)
    never = torch.tensor([NEVER])
    first = [bank.step([a], x[None], never).raw.item() for x in xs]
    # row b runs interleaved garbage; then row a is reset for its next request
    for _ in range(3):
        bank.step([b], torch.randn(1, D) * 5, never)
    bank.reset(a)
    again = [bank.step([a], x[None], never).raw.item() for x in xs]
    assert first == again


def test_stop_decision_uses_smoothed_score_and_skips_update() -> None:
    probe = Probe(ProbeSpec(dim=D), seed=0)
    with torch.no_grad():
        probe.params["b"].fill_(3.0)  # score ~0.95 at the start
    bank = ProbeBank(probe, window=2)
    rows = torch.tensor([0, 1])
    x = torch.randn(2, D)
    res = bank.step(rows, x, torch.tensor([0.9, NEVER]))
    assert res.stop.tolist() == [True, False]
    assert res.steps.tolist() == [1, 1]
    snap = bank.snapshot(int(rows[0]))
    torch.testing.assert_close(snap["w"], probe.params["w"].detach())  # stopped row not updated
    assert not torch.equal(bank.snapshot(int(rows[1]))["w"], probe.params["w"].detach())


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_stopping_rows_keep_their_weights_exactly(spec: ProbeSpec) -> None:
    """The frozen (zero) step of a stopping row leaves every fast weight bit-identical, also when
    the rows are scattered (the gather/scatter path) and for every variant."""
    probe = _perturbed(spec).float()
    bank = ProbeBank(probe, window=2)
    rows = [0, 1, 2]
    before = {r: bank.snapshot(r) for r in rows}
    step_rows = torch.tensor([rows[2], rows[0]])  # not contiguous
    res = bank.step(step_rows, torch.randn(2, D), torch.tensor([0.0, NEVER]))  # row 2 stops
    assert res.stop.tolist() == [True, False]
    for k in probe.fast_keys():
        assert torch.equal(bank.snapshot(rows[2])[k], before[rows[2]][k]), k
        assert torch.equal(bank.snapshot(rows[1])[k], before[rows[1]][k]), k  # not stepped
    assert any(not torch.equal(bank.snapshot(rows[0])[k], before[rows[0]][k])
               for k in probe.fast_keys())


def test_snapshot_restore_survives_row_change() -> None:
    probe = _perturbed(ProbeSpec(dim=D, kind="qk", d_h=8, mlp=True)).float()
    xs = torch.randn(8, D)
    never = torch.tensor([NEVER])
    ref = ProbeBank(probe, window=3)
    r = torch.tensor([0])
    expected = [ref.step(r, x[None], never).smoothed.item() for x in xs]

    bank = ProbeBank(probe, window=3)
    row = 0
    got = [bank.step(torch.tensor([row]), x[None], never).smoothed.item() for x in xs[:4]]
    snap = bank.snapshot(row)
    bank.reset(row)  # someone else takes the row
    bank.step(torch.tensor([row]), torch.randn(1, D), never)
    new = 1
    bank.restore(new, snap)
    got += [bank.step(torch.tensor([new]), x[None], never).smoothed.item() for x in xs[4:]]
    assert got == pytest.approx(expected, abs=1e-6)


def test_pooling_modes() -> None:
    h = torch.randn(5, D) * 10
    tok = normalize_tokens(h, "token-l2")
    torch.testing.assert_close(tok.norm(dim=-1), torch.ones(5))
    phi = finish_step(tok.sum(0, keepdim=True), torch.tensor([5]), "none")
    torch.testing.assert_close(phi[0], tok.mean(0))
    phi2 = finish_step(h.sum(0, keepdim=True), torch.tensor([5]), "step-l2")
    torch.testing.assert_close(phi2.norm(), torch.tensor(1.0))


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="d_h"):
        ProbeSpec(dim=8, kind="qk")
    with pytest.raises(ValueError, match="MLP"):
        ProbeSpec(dim=8, kind="qk", d_h=4, mlp=True, norm="ln")
    with pytest.raises(ValueError):
        ProbeSpec(dim=8, d_h=4)
