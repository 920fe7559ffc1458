"""Test fixtures in the authors' released formats, written from reading their research code.

* `authors_pickle`: a dataset pickle shaped like their released ones. Their pipeline splits the
  reasoning text into steps (a new step at every line containing "wait"/"Wait"/"but"/"But"),
  labels the answer forced after every block of `batch_size` such steps, and only then cuts steps
  longer than 500 tokens into 500-token chunks, embedding each non-empty chunk. So a problem has
  ceil(U / batch_size) labels for U steps but one embedding per chunk: usually more embeddings
  than batch_size x labels covers.
* `AuthorsProbe`: their TTT probe's scoring and online step (score, then one gradient step of the
  squared error towards pseudo-label 0), on their parameter names and shapes, one trajectory at a
  time and in float64, as an independent reference for `orca_method.probe`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

CHUNK = 500


def authors_problem(rng: np.random.Generator, dim: int, batch_size: int = 10,
                    strip_text: bool = False, empty_first_step: bool = False) -> dict:
    """One problem record of a release-format pickle, with its hidden generation facts."""
    n_steps = int(rng.integers(3, 40))
    lengths = rng.integers(5, 1400, size=n_steps)  # tokens per step, some over 500
    if empty_first_step:  # a trajectory whose first line has a keyword: step 0 is empty
        lengths[0] = 0
    limits, pos = [], int(rng.integers(20, 60))  # the prompt before the reasoning
    for k in lengths:
        start, end = pos, pos + int(k)
        limits += ([(start, end)] if end - start <= CHUNK else
                   [(a, min(a + CHUNK, end)) for a in range(start, end, CHUNK)])
        pos = end + 1  # the "\n\n" between steps belongs to no step
    if empty_first_step:
        limits.insert(0, (limits[0][0] - 1, limits[0][0] - 1))
    n_emb = sum(1 for a, b in limits if b > a)
    n_labels = math.ceil(n_steps / batch_size)
    first_correct = int(rng.integers(0, n_labels + 1))
    prob = {
        "problem_idx": None,  # set by the caller
        "step_embeddings": rng.standard_normal((n_emb, dim)).astype(np.float32) * 3,
        "step_limits": limits,
        "step_labels": [int(j >= first_correct) for j in range(n_labels)],
        "step_labels_consistent": [int(j >= first_correct // 2) for j in range(n_labels)],
    }
    if not strip_text:
        prob |= {"question": "What is 6 x 7?", "answer": "42",
                 "trajectory": "Six sevens.\nWait, 42.", "truncated_answers": ["42"] * n_labels}
    return prob


def authors_pickle(seed: int, n_problems: int, dim: int, *, strip_text: bool = False,
                   with_splits: bool = True) -> dict:
    """A dataset pickle in the release format (`4_merge.py --release_format [--strip_text]`)."""
    rng = np.random.default_rng(seed)
    problems = []
    for i in range(n_problems):
        p = authors_problem(rng, dim, strip_text=strip_text, empty_first_step=i % 7 == 3)
        p["problem_idx"] = i
        problems.append(p)
    data = {"model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "teacher_model": "Qwen/Qwen3-32B",
            "embed_dim": dim, "batch_size": 10, "problems": problems}
    if with_splits:
        third = n_problems // 3
        data["splits"] = {"train": list(range(third)),
                          "calibration": list(range(third, 2 * third)),
                          "test": list(range(2 * third, n_problems))}
        data["splits_wu"] = {"train": [0], "calibration": [1], "test": [2]}
    return data


def authors_alignment(prob: dict, batch_size: int = 10, key: str = "step_labels"
                      ) -> tuple[np.ndarray, list[int]]:
    """What their training/calibration loops use: embeddings and per-embedding labels, both cut
    to the shorter of (embeddings, batch_size x labels), embedding t labelled by block t // B."""
    labels = list(prob[key])
    if 1 in labels:  # cumulative: once correct, stays correct
        first = labels.index(1)
        labels = [0] * first + [1] * (len(labels) - first)
    per_step = [lab for lab in labels for _ in range(batch_size)]
    per_step = per_step[:len(prob["step_embeddings"])]
    return prob["step_embeddings"][:len(per_step)], per_step


# ------------------------------------------------------------------------------------- probes


def authors_state_dict(dim: int, *, no_kq: bool = True, d_hidden: int = 16, use_ln: bool = False,
                       share_kq: bool = False, use_mlp: bool = False,
                       learnable_eta: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """A trained-looking `probe.pt` state dict with their parameter names and shapes."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    d_w = dim if no_kq else d_hidden
    sd: dict[str, torch.Tensor] = {}
    if not no_kq:
        sd["theta_K.weight"] = rnd(d_hidden, dim, scale=1 / math.sqrt(dim))
        # a shared projection is one module registered under both names
        sd["theta_Q.weight"] = (sd["theta_K.weight"] if share_kq
                                else rnd(d_hidden, dim, scale=1 / math.sqrt(dim)))
    if use_mlp:
        sd |= {"W10": rnd(d_w, 4 * d_w), "b10": rnd(1, 4 * d_w), "W20": rnd(4 * d_w, 1),
               "b20": rnd(1)}
    else:
        sd |= {"W0": rnd(1, d_w), "b0": rnd(1)}
    if learnable_eta:
        sd |= {"lr_weight": rnd(1, dim), "lr_bias": rnd(1)}
    else:
        sd["log_eta"] = torch.tensor(math.log(0.05))
    if use_ln:
        sd |= {"ln_weight": 1 + rnd(d_w), "ln_bias": rnd(d_w)}
    return sd


class AuthorsProbe:
    """Their probe's forward and online update, re-derived with autograd (not their closed form):
    the fast weights take one plain gradient step of (p - 0)^2 after each score."""

    def __init__(self, sd: dict[str, torch.Tensor], *, use_ln: bool = False,
                 use_residual: bool = False, base_lr: float = 0.01, ln_eps: float = 1e-6):
        self.sd = {k: v.double() for k, v in sd.items()}
        self.no_kq = "theta_K.weight" not in sd
        self.mlp = "W10" in sd
        self.use_ln, self.use_residual = use_ln, use_residual
        self.base_lr, self.ln_eps = base_lr, ln_eps

    def _fast0(self) -> dict[str, torch.Tensor]:
        keys = ("W10", "b10", "W20", "b20") if self.mlp else ("W0", "b0")
        return {k: self.sd[k].clone() for k in keys}

    def _proj(self, phi: torch.Tensor, name: str) -> torch.Tensor:
        return phi if self.no_kq else self.sd[name] @ phi

    def _logit(self, fast: dict[str, torch.Tensor], u: torch.Tensor, inner: bool) -> torch.Tensor:
        if self.mlp:  # tanh-approximated GELU on both paths
            h = F.gelu(u @ fast["W10"] + fast["b10"][0], approximate="tanh")
            return h @ fast["W20"][:, 0] + fast["b20"][0]
        z = fast["W0"][0] * u
        if inner and self.use_ln:  # LayerNorm only inside the inner loss
            zn = F.layer_norm(z, z.shape, self.sd["ln_weight"], self.sd["ln_bias"], self.ln_eps)
            z = z + zn if self.use_residual else zn
        return z.sum() + fast["b0"][0]

    def _eta(self, phi: torch.Tensor) -> torch.Tensor:
        if "lr_weight" in self.sd:
            return self.base_lr * torch.sigmoid(self.sd["lr_weight"][0] @ phi + self.sd["lr_bias"][0])
        return self.sd["log_eta"].exp()

    def scores(self, phis: np.ndarray) -> list[float]:
        """Raw scores of one trajectory [T, d] under score-then-update."""
        fast = self._fast0()
        out = []
        for phi in torch.from_numpy(np.asarray(phis)).double():
            out.append(float(torch.sigmoid(self._logit(fast, self._proj(phi, "theta_Q.weight"),
                                                       inner=False))))
            fast = {k: v.detach().requires_grad_(True) for k, v in fast.items()}
            p = torch.sigmoid(self._logit(fast, self._proj(phi, "theta_K.weight"), inner=True))
            grads = torch.autograd.grad((p - 0.0) ** 2, list(fast.values()))
            eta = self._eta(phi)
            fast = {k: (v - eta * g).detach() for (k, v), g in zip(fast.items(), grads)}
        return out


def smooth(scores: list[float], window: int) -> list[float]:
    """Their smoothing: the mean of the last `window` raw scores (fewer at the start)."""
    return [float(np.mean(scores[max(0, t + 1 - window):t + 1])) for t in range(len(scores))]
