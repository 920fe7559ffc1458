"""The ORCA probe: slow weights, fast-weight state and the closed-form inner step.

One implementation serves three callers: the server (no grad, a few rows per engine step),
calibration replay (no grad, many trajectories) and meta-training (autograd through the unroll).
The inner gradients are written in closed form so inference never needs autograd; because they are
plain torch ops, meta-training differentiates *through* them and so trains exactly what is deployed.

Fast state is a dict of tensors whose leading dimension is the request row. docs/METHOD.md section 2.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import get_type_hints

import torch
from torch import Tensor, nn

Fast = dict[str, Tensor]

LN_EPS = 1e-5
ETA_INIT = 0.01
W0_STD = 0.02


class Kind(StrEnum):
    """The fast weights' input: the step embedding itself, or its projections (paper, Table 5)."""

    NOQK = "noqk"  # u = q = phi
    QK = "qk"  # u = theta_K phi, q = theta_Q phi (d_h each)


class InnerNorm(StrEnum):
    """A LayerNorm inside the inner loss (never on the scoring path)."""

    NONE = "none"
    LN = "ln"
    LN_RES = "ln_res"  # LayerNorm plus the residual


class EtaMode(StrEnum):
    FIXED = "fixed"  # eta_0
    INPUT = "input"  # eta_0 * sigmoid(a . phi + c)


class Gelu(StrEnum):
    """The MLP probe's activation (torch's `approximate`: none or tanh)."""

    ERF = "erf"
    TANH = "tanh"


@dataclass(frozen=True)
class ProbeSpec:
    """Which variant of the probe (paper, Table 5). The default is the no-QK linear probe."""

    dim: int
    kind: Kind = Kind.NOQK
    d_h: int | None = None  # projection size for QK
    shared_qk: bool = False  # theta_Q = theta_K
    norm: InnerNorm = InnerNorm.NONE  # LayerNorm inside the inner loss
    eta_mode: EtaMode = EtaMode.FIXED  # input-dependent eta(phi)
    mlp: bool = False  # 2-layer MLP fast weights (hidden 4 d_w, GELU)
    online: bool = True  # False: no inner update (the static baseline folded into a linear probe)
    ln_eps: float = LN_EPS  # epsilon of the inner LayerNorm (the authors' released probes: 1e-6)
    gelu: Gelu = Gelu.ERF  # MLP activation (the authors' probes: tanh approximation)

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"probe dim must be >= 1, got {self.dim}")
        # a word (a bundle's JSON, a job's options) becomes its member
        for name, words in SPEC_WORDS.items():
            try:
                object.__setattr__(self, name, words(getattr(self, name)))
            except ValueError:
                raise ValueError(f"probe {name} must be one of {[str(w) for w in words]}, "
                                 f"got {getattr(self, name)!r}") from None
        if self.kind == Kind.QK and not (self.d_h and self.d_h >= 1):
            raise ValueError("a QK probe needs d_h >= 1")
        if self.kind == Kind.NOQK and (self.d_h is not None or self.shared_qk):
            raise ValueError("d_h and shared_qk only apply to the QK probe")
        if not self.ln_eps > 0:
            raise ValueError(f"ln_eps must be > 0, got {self.ln_eps}")
        if self.mlp and self.norm != InnerNorm.NONE:
            raise ValueError("the MLP probe does not take a LayerNorm inner loss")
        if not self.online and (self.kind, self.norm, self.eta_mode, self.mlp) != (
                Kind.NOQK, InnerNorm.NONE, EtaMode.FIXED, False):
            raise ValueError("a static (online=False) probe is the plain linear no-QK probe")

    @property
    def d_w(self) -> int:
        """Width of the fast weights' input."""
        return self.d_h if self.kind == Kind.QK else self.dim

    @property
    def hidden(self) -> int:
        return 4 * self.d_w

    @property
    def name(self) -> str:
        if not self.online:
            return "static"
        parts = [str(self.kind) if self.kind == Kind.NOQK else f"qk{self.d_h}"]
        parts += ["shared"] if self.shared_qk else []
        parts += [str(self.norm)] if self.norm != InnerNorm.NONE else []
        parts += ["eta-input"] if self.eta_mode == EtaMode.INPUT else []
        parts += ["mlp"] if self.mlp else []
        return "-".join(parts)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> ProbeSpec:
        return cls(**d)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of every slow weight: what a loaded bundle is checked against."""
        d, dw, h = self.dim, self.d_w, self.hidden
        shapes: dict[str, tuple[int, ...]] = {"log_eta": ()}
        if self.kind == Kind.QK:
            shapes["theta_q"] = (dw, d)
            if not self.shared_qk:
                shapes["theta_k"] = (dw, d)
        if self.mlp:
            shapes |= {"w1": (h, dw), "b1": (h,), "w2": (h,), "b2": ()}
        else:
            shapes |= {"w": (dw,), "b": ()}
        if self.norm != InnerNorm.NONE:
            shapes |= {"ln_gamma": (dw,), "ln_beta": (dw,)}
        if self.eta_mode == EtaMode.INPUT:
            shapes |= {"eta_a": (d,), "eta_c": ()}
        return shapes


# ProbeSpec's closed-set fields and their enums, read off its annotations: a member compares,
# hashes and serialises as its word, so a spec built from words equals one built from members
SPEC_WORDS: dict[str, type[StrEnum]] = {
    name: hint for name, hint in get_type_hints(ProbeSpec).items()
    if isinstance(hint, type) and issubclass(hint, StrEnum)}


class Probe(nn.Module):
    """Slow weights (meta-learned) plus the per-request inner loop over fast weights."""

    def __init__(self, spec: ProbeSpec, seed: int | None = None) -> None:
        super().__init__()
        self.spec = spec
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        shapes = spec.param_shapes()
        params = {}
        for name, shape in shapes.items():
            params[name] = nn.Parameter(self._init(name, shape, gen))
        self.params = nn.ParameterDict(params)

    def _init(self, name: str, shape: tuple[int, ...], gen: torch.Generator | None) -> Tensor:
        spec = self.spec
        if name == "log_eta":
            return torch.tensor(math.log(ETA_INIT))
        if name in ("w", "w2"):
            return torch.randn(shape, generator=gen) * W0_STD
        if name in ("theta_q", "theta_k"):
            return torch.randn(shape, generator=gen) / math.sqrt(spec.dim)
        if name == "w1":
            return torch.randn(shape, generator=gen) / math.sqrt(spec.d_w)
        if name == "ln_gamma":
            return torch.ones(shape)
        return torch.zeros(shape)  # biases, ln_beta, eta_a, eta_c

    # -- state ---------------------------------------------------------------------------
    def fast_keys(self) -> tuple[str, ...]:
        return ("w1", "b1", "w2", "b2") if self.spec.mlp else ("w", "b")

    def init_fast(self, n: int) -> Fast:
        """Fast weights of n fresh requests: copies of the slow initialisation (reset = this)."""
        return {k: self.params[k].unsqueeze(0).expand(n, *self.params[k].shape).clone()
                for k in self.fast_keys()}

    # -- features ------------------------------------------------------------------------
    def query(self, phi: Tensor) -> Tensor:
        return phi @ self.params["theta_q"].T if self.spec.kind == Kind.QK else phi

    def key(self, phi: Tensor) -> Tensor:
        if self.spec.kind == Kind.NOQK:
            return phi
        theta = self.params["theta_q" if self.spec.shared_qk else "theta_k"]
        return phi @ theta.T

    def eta(self, phi: Tensor) -> Tensor:
        """Inner learning rate per row: eta_0, or eta_0 * sigmoid(a . phi + c)."""
        eta0 = self.params["log_eta"].exp()
        if self.spec.eta_mode == EtaMode.FIXED:
            return eta0.expand(phi.shape[0])
        return eta0 * torch.sigmoid(phi @ self.params["eta_a"] + self.params["eta_c"])

    # -- score and inner step --------------------------------------------------------------
    def logit(self, fast: Fast, q: Tensor, scratch: Tensor | None = None) -> Tensor:
        """Score logit (no LayerNorm on the scoring path, docs/METHOD.md section 2).

        `scratch` ([rows, d_w]) lets the server reuse memory for the row-wise product.
        """
        if self.spec.mlp:
            a = torch.einsum("nhd,nd->nh", fast["w1"], q) + fast["b1"]
            return (fast["w2"] * self._gelu(a)).sum(-1) + fast["b2"]
        return _rowdot(fast["w"], q, scratch) + fast["b"]

    def score(self, fast: Fast, phi: Tensor) -> Tensor:
        return torch.sigmoid(self.logit(fast, self.query(phi)))

    @property
    def shares_logit(self) -> bool:
        """The inner loss's logit equals the score logit (same weights, q = u, no LayerNorm)."""
        spec = self.spec
        return (not spec.mlp and spec.norm == InnerNorm.NONE
                and (spec.kind == Kind.NOQK or spec.shared_qk))

    def inner_terms(self, fast: Fast, u: Tensor, target: float | Tensor = 0.0,
                    z: Tensor | None = None) -> tuple[Tensor, Tensor, Fast]:
        """Closed-form gradient of the Brier inner loss (p - C)^2, factored as g * partial.

        Returns (p, g, partials) with grad_k = g * partials[k] (g = dloss/dlogit). Factoring lets
        the server apply the step in place without materialising a [rows, d] gradient; writing it
        out keeps inference free of autograd, and tests check it against autograd for every variant.
        `z` is the inner logit when the caller already has it (see `shares_logit`).
        """
        if self.spec.mlp:
            a = torch.einsum("nhd,nd->nh", fast["w1"], u) + fast["b1"]
            hid = self._gelu(a)
            p = torch.sigmoid((fast["w2"] * hid).sum(-1) + fast["b2"])
            dz_da = fast["w2"] * (_gelu_tanh_grad(a) if self.spec.gelu == Gelu.TANH
                             else _gelu_grad(a))
            parts = {"w1": dz_da[:, :, None] * u[:, None, :], "b1": dz_da, "w2": hid,
                     "b2": torch.ones_like(p)}
        else:
            z, dz_dw = (z, u) if z is not None and self.spec.norm == InnerNorm.NONE else \
                self._inner_logit(fast, u)
            p = torch.sigmoid(z)
            parts = {"w": dz_dw, "b": torch.ones_like(p)}
        g = 2 * (p - target) * p * (1 - p)
        return p, g, parts

    def _gelu(self, a: Tensor) -> Tensor:
        return nn.functional.gelu(a, approximate="tanh" if self.spec.gelu == Gelu.TANH else "none")

    def _inner_logit(self, fast: Fast, u: Tensor) -> tuple[Tensor, Tensor]:
        """Logit of the inner loss and its derivative w.r.t. the linear fast weights."""
        if self.spec.norm == InnerNorm.NONE:
            return _rowdot(fast["w"], u) + fast["b"], u
        x = fast["w"] * u
        gamma, beta = self.params["ln_gamma"], self.params["ln_beta"]
        mu = x.mean(-1, keepdim=True)
        sigma = (x.var(-1, unbiased=False, keepdim=True) + self.spec.ln_eps).sqrt()
        xhat = (x - mu) / sigma
        z = (gamma * xhat + beta).sum(-1) + fast["b"]
        # d sum(LN(x)) / dx: the LayerNorm backward with upstream gradient gamma.
        dz_dx = (gamma - gamma.mean() - xhat * (gamma * xhat).mean(-1, keepdim=True)) / sigma
        if self.spec.norm == InnerNorm.LN_RES:
            z = z + x.sum(-1)
            dz_dx = dz_dx + 1
        return z, dz_dx * u

    def inner_grads(self, fast: Fast, u: Tensor, target: float | Tensor = 0.0) -> tuple[Tensor, Fast]:
        """(p, gradient of the inner loss w.r.t. each fast weight)."""
        p, g, parts = self.inner_terms(fast, u, target)
        return p, {k: _bcast(g, v) * v for k, v in parts.items()}

    def _step_coefs(self, fast: Fast, phi: Tensor,
                    z: Tensor | None = None) -> tuple[Tensor, Fast]:
        """(eta * g per row, partials): the inner step is W_k <- W_k - coef * partials[k]."""
        _, g, parts = self.inner_terms(fast, self.key(phi), z=z)
        return self.eta(phi) * g, parts

    def update(self, fast: Fast, phi: Tensor) -> Fast:
        """One inner step W <- W - eta * grad with pseudo-label 0 (functional, differentiable)."""
        if not self.spec.online:
            return fast
        coef, parts = self._step_coefs(fast, phi)
        return {k: fast[k] - _bcast(coef, v) * v for k, v in parts.items()}

    @torch.no_grad()
    def update_(self, fast: Fast, phi: Tensor, score_logit: Tensor | None = None,
                frozen: Tensor | None = None) -> None:
        """The same step applied in place (the server's path: no [rows, d] temporaries).

        Pass the score logit just computed on these fast weights to skip recomputing it. Rows
        where `frozen` (bool [rows]) is set keep their weights exactly (a zero step): masking on
        the device avoids a host sync to find them.
        """
        if not self.spec.online:
            return
        coef, parts = self._step_coefs(fast, phi, score_logit if self.shares_logit else None)
        if frozen is not None:
            coef = coef.masked_fill(frozen, 0.0)
        for k, v in parts.items():
            fast[k].addcmul_(v, _bcast(coef, v), value=-1)

    def unroll(self, phi: Tensor, mask: Tensor) -> Tensor:
        """Raw scores of padded trajectories phi [B, T, d] (mask [B, T]) under score-then-update.

        Used by meta-training with autograd; padded steps leave the fast weights unchanged.
        """
        fast = self.init_fast(phi.shape[0])
        scores = []
        for t in range(phi.shape[1]):
            x = phi[:, t]
            scores.append(self.score(fast, x))
            new = self.update(fast, x)
            m = mask[:, t]
            fast = {k: torch.where(_bcast(m, v), new[k], v) for k, v in fast.items()}
        return torch.stack(scores, 1)

    def check_finite(self) -> None:
        for name, p in self.params.items():
            if not torch.isfinite(p).all():
                raise ValueError(f"probe weight '{name}' contains NaN or inf")


def _gelu_grad(a: Tensor) -> Tensor:
    """Derivative of the exact (erf) GELU: Phi(a) + a * phi(a)."""
    cdf = 0.5 * (1 + torch.erf(a / math.sqrt(2)))
    pdf = torch.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)
    return cdf + a * pdf


def _gelu_tanh_grad(a: Tensor) -> Tensor:
    """Derivative of the tanh-approximated GELU 0.5 a (1 + tanh(k (a + c a^3)))."""
    k, c = math.sqrt(2 / math.pi), 0.044715
    t = torch.tanh(k * (a + c * a ** 3))
    return 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * k * (1 + 3 * c * a * a)


def _rowdot(a: Tensor, b: Tensor, scratch: Tensor | None = None) -> Tensor:
    """Per-row dot product; with `scratch`, the product reuses memory (bmm is slower on CPU)."""
    if scratch is None:
        return (a * b).sum(-1)
    return torch.mul(a, b, out=scratch[:a.shape[0]]).sum(-1)


def _bcast(v: Tensor, like: Tensor) -> Tensor:
    """Reshape a per-row vector so it broadcasts against a [n, ...] tensor."""
    return v.reshape(v.shape[0], *([1] * (like.dim() - 1)))
