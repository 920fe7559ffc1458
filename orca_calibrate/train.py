"""Meta-training of the probe's slow weights (outer loop, METHOD.md section 3) and the static baseline.

The outer loop unrolls the deployed inner loop (pseudo-label 0 updates) over whole trajectories and
back-propagates the Brier loss against the true cumulative labels through it. For the linear probes
without LayerNorm, the unroll is computed in its kernel form (a differentiable twin of
`Probe.unroll`, pinned to it by a test): the fast weights after t steps are W0 minus a weighted sum
of past keys, so every logit only needs Gram matrices of the trajectory and a scalar recurrence.
That turns a d-wide loop into one batched matmul and makes paper-scale training take minutes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from scipy.optimize import minimize

from orca_calibrate.job_options import DEFAULT_WINDOW
from orca_calibrate.probe_variants import PROBES
from orca_calibrate.progress import progress_bar
from orca_calibrate.train_defaults import (
    DEFAULTS,
    EPOCH_SELECT,
    MIN_TRAIN_PROBLEMS,
    check_training,
    lr_for_batch,
)
from orca_calibrate.train_resume import Best, Checkpoints, training_key
from orca_method.give_up import right_ahead
from orca_method.ltt import calibrate
from orca_method.probe import InnerNorm, Kind, Probe, ProbeSpec
from orca_method.procedure import as_tensor, replay
from orca_method.risk import is_solvable
from orca_method.trajectories import Split, TrajectorySet

VALIDATION_DELTA = 0.1


@dataclass
class Batch:
    phi: torch.Tensor  # [B, T, d] float32, zero padded
    labels: torch.Tensor  # [B, T] float32 cumulative labels
    mask: torch.Tensor  # [B, T] bool
    gram: torch.Tensor | None = None  # [B, T, T] phi_s . phi_t, when cached


@dataclass
class TrainResult:
    probe: Probe
    epoch: int  # selected epoch (1-based)
    history: list[dict] = field(default_factory=list)


def solvable(ts: TrajectorySet, indices: list[int], mode: str) -> list[int]:
    """Problems whose label is 1 at some step: the others are left out (METHOD.md section 3)."""
    return [i for i in indices if is_solvable(ts.labels(i, mode))]


class Loader:
    """Padded batches read from the memory map into one reused buffer.

    Batches group problems of similar length (less padding, fewer unroll steps). For the no-QK
    kernel form the Gram matrices phi_s . phi_t do not depend on the weights: they are computed
    on the first pass and kept (about 4 T^2 bytes per problem), which removes the dominant cost
    of every later epoch.
    """

    def __init__(self, ts: TrajectorySet, mode: str, batch_size: int, cache_gram: bool) -> None:
        self.ts, self.mode, self.batch_size = ts, mode, batch_size
        self.cache_gram = cache_gram
        self._gram: dict[int, torch.Tensor] = {}
        self._buf = torch.empty(0)

    def batches(self, indices: list[int], rng: np.random.Generator | None = None) -> Iterator[Batch]:
        order = list(indices) if rng is None else rng.permutation(indices).tolist()
        groups = []
        span = self.batch_size * 16
        for start in range(0, len(order), span):
            chunk = sorted(order[start:start + span], key=lambda i: self.ts.problems[i].n_steps)
            groups += [chunk[j:j + self.batch_size] for j in range(0, len(chunk), self.batch_size)]
        if rng is not None:
            groups = [groups[j] for j in rng.permutation(len(groups))]
        for g in groups:
            yield self.load(g)

    def load(self, indices: list[int]) -> Batch:
        lengths = [self.ts.problems[i].n_steps for i in indices]
        b, t, d = len(indices), max(lengths), self.ts.dim
        if self._buf.numel() < b * t * d:
            self._buf = torch.empty(b * t * d)
        phi = self._buf[:b * t * d].view(b, t, d)
        labels = torch.zeros(b, t)
        for r, i in enumerate(indices):
            # copy_ converts float16 -> float32 on the way, with no temporary array
            phi[r, :lengths[r]].copy_(as_tensor(self.ts.embeddings(i)))
            phi[r, lengths[r]:] = 0
            labels[r, :lengths[r]] = torch.from_numpy(self.ts.labels(i, self.mode).astype(np.float32))
        mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
        gram = None
        if self.cache_gram:
            gram = torch.zeros(b, t, t)
            for r, i in enumerate(indices):
                if i not in self._gram:
                    x = phi[r, :lengths[r]]
                    self._gram[i] = x @ x.T
                gram[r, :lengths[r], :lengths[r]] = self._gram[i]
        return Batch(phi, labels, mask, gram)


def kernel_form(spec: ProbeSpec) -> bool:
    """Variants whose unroll has the Gram-matrix form (linear fast weights, no LayerNorm)."""
    return not spec.mlp and spec.norm == InnerNorm.NONE


def unroll_scores(probe: Probe, phi: torch.Tensor, mask: torch.Tensor,
                  gram: torch.Tensor | None = None) -> torch.Tensor:
    """Raw scores [B, T] of the deployed inner loop, differentiable w.r.t. the slow weights.

    `gram` (phi phi^T per trajectory) may be passed for the no-QK probe, whose kernel it is.
    """
    if not kernel_form(probe.spec):
        return probe.unroll(phi, mask)
    q, u = probe.query(phi), probe.key(phi)  # [B, T, d_w]
    w0, b0 = probe.params["w"], probe.params["b"]
    zq0, zu0 = q @ w0 + b0, u @ w0 + b0
    if not probe.spec.online:
        return torch.sigmoid(zq0)
    if gram is not None and probe.spec.kind == Kind.NOQK:
        kq = gram + 1
    else:
        kq = torch.bmm(u, q.transpose(1, 2)) + 1  # [B, s, t]: u_s . q_t + 1 (the +1 is the bias)
    ku = kq if probe.spec.kind == Kind.NOQK else torch.bmm(u, u.transpose(1, 2)) + 1
    eta = probe.eta(phi.reshape(-1, phi.shape[-1])).reshape(mask.shape) * mask
    steps: list[torch.Tensor] = []  # eta_s * g_s of past steps
    scores = []
    for t in range(phi.shape[1]):
        past = torch.stack(steps, 1) if steps else zq0.new_zeros(phi.shape[0], 0)
        zq = zq0[:, t] - (past * kq[:, :t, t]).sum(1)
        zu = zu0[:, t] - (past * ku[:, :t, t]).sum(1)
        p = torch.sigmoid(zu)
        steps.append(eta[:, t] * 2 * p * p * (1 - p))  # Brier gradient factor with target 0
        scores.append(torch.sigmoid(zq))
    return torch.stack(scores, 1)


def outer_loss(scores: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean over steps of (s_t - C_t)^2 per trajectory, averaged over the batch."""
    err = ((scores - batch.labels) ** 2) * batch.mask
    return (err.sum(1) / batch.mask.sum(1)).mean()


def _validation_savings(probe: Probe, ts: TrajectorySet, val: list[int], mode: str,
                        window: int) -> float:
    """The paper's savings (per problem) at delta 0.1 after LTT on the validation part."""
    runs = replay(probe, [ts.embeddings(i) for i in val], window=window)
    scores = [s.numpy() for _, s in runs]
    labels = [ts.labels(i, mode) for i in val]
    [res] = calibrate(scores, labels, [VALIDATION_DELTA])
    return res.savings_per_problem


def training_settings(spec: ProbeSpec, options: dict) -> dict:
    """`meta_train` settings from user options: absent or None take `DEFAULTS` (epochs: 20 for
    no-QK, 10 for QK, as the paper; lr from the batch size by `lr_for_batch`)."""
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown training settings {sorted(unknown)} (known: {sorted(DEFAULTS)})")
    settings = DEFAULTS | {k: v for k, v in options.items() if v is not None}
    if options.get("epochs") is None and spec.kind != Kind.NOQK:
        settings["epochs"] = 10
    check_training(**settings)
    if settings["lr"] is None:
        settings["lr"] = lr_for_batch(settings["batch_size"])
    return settings


def meta_train(ts: TrajectorySet, spec: ProbeSpec, mode: str, *, epochs: int = DEFAULTS["epochs"],
               batch_size: int = DEFAULTS["batch_size"], lr: float | None = None,
               warmup: float = DEFAULTS["warmup"], clip: float = 1.0, seed: int = 0,
               epoch_select: str = DEFAULTS["epoch_select"], val_fraction: float = 0.1,
               window: int = DEFAULT_WINDOW, checkpoints: Path | None = None,
               progress: bool = True) -> TrainResult:
    """Adam on the outer loss; returns the probe of the selected epoch.

    `epoch_select="validation"` holds out `val_fraction` of the training problems and keeps the
    epoch with the best validation savings; `"last"` (the paper's protocol) trains on all of
    them and keeps the last epoch. `warmup` is the fraction of all steps over which the
    learning rate rises linearly from 0 to `lr` (default `lr_for_batch(batch_size)`).
    `checkpoints`: a folder for the state after every epoch; a rerun with the same settings and
    data goes on after the last epoch saved there (`orca_calibrate.train_resume`).
    """
    check_training(batch_size, lr, epochs, epoch_select, warmup)
    lr = lr_for_batch(batch_size) if lr is None else lr
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    train = solvable(ts, ts.split(Split.TRAIN), mode)
    if len(train) < MIN_TRAIN_PROBLEMS:
        raise ValueError(f"the training split has {len(train)} problems with a correct step under "
                         f"label mode '{mode}'; at least {MIN_TRAIN_PROBLEMS} are needed")
    order = rng.permutation(train).tolist()
    n_val = max(1, round(val_fraction * len(order))) if epoch_select == "validation" else 0
    val, fit = order[:n_val], order[n_val:]
    probe = Probe(spec, seed=seed)
    opt = torch.optim.Adam(probe.parameters(), lr=lr)
    per_epoch = math.ceil(len(fit) / batch_size)
    n_warm = round(warmup * epochs * per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / (n_warm + 1)))
    history: list[dict] = []
    best: Best | None = None
    ckpt = None
    if checkpoints is not None:
        settings = {"epochs": epochs, "batch_size": batch_size, "lr": lr, "warmup": warmup,
                    "clip": clip, "seed": seed, "epoch_select": epoch_select,
                    "val_fraction": val_fraction, "window": window}
        ckpt = Checkpoints(checkpoints, training_key(ts, fit + val, spec, mode, settings))
    resumed = ckpt.resume(probe, opt, sched, rng) if ckpt is not None else None
    if resumed is not None:
        history, best = resumed.history, resumed.best
    done = resumed.epoch if resumed is not None else 0
    loader = Loader(ts, mode, batch_size, cache_gram=kernel_form(spec) and spec.kind == Kind.NOQK)
    bar = progress_bar(total=epochs * per_epoch, initial=done * per_epoch,
                       desc=f"meta-train {spec.name}", disable=not progress, unit="batch")
    # the time rows count from the first epoch's start, across a resume
    ran = (history[-1]["seconds"], history[-1]["cpu_seconds"]) if history else (0.0, 0.0)
    start, cpu_start = time.perf_counter() - ran[0], time.process_time() - ran[1]
    for epoch in range(done + 1, epochs + 1):
        losses = []
        for batch in loader.batches(fit, rng):
            loss = outer_loss(unroll_scores(probe, batch.phi, batch.mask, batch.gram), batch)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(probe.parameters(), clip)
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.update()
            bar.set_postfix(epoch=epoch, loss=f"{np.mean(losses):.4f}", refresh=False)
        probe.check_finite()
        row = {"epoch": epoch, "train_loss": float(np.mean(losses)),
               "eta": probe.params["log_eta"].exp().item()}
        if epoch_select == "validation":
            with torch.no_grad():
                row["val_loss"] = float(np.mean([
                    outer_loss(unroll_scores(probe, vb.phi, vb.mask, vb.gram), vb).item()
                    for vb in loader.batches(val)]))
            row["val_savings"] = _validation_savings(probe, ts, val, mode, window)
            if best is None or (row["val_savings"], -row["val_loss"]) > best[:2]:
                state = {k: v.detach().clone() for k, v in probe.state_dict().items()}
                best = (row["val_savings"], -row["val_loss"], epoch, state)
        # since the start, validation included; CPU time is the figure to compare on a busy machine
        row["seconds"] = time.perf_counter() - start
        row["cpu_seconds"] = time.process_time() - cpu_start
        history.append(row)
        if ckpt is not None:
            save_probe(probe, ckpt.folder / f"epoch_{epoch:03d}.safetensors", {"epoch": epoch})
            ckpt.save(epoch, probe, opt, sched, rng, history, best)
    bar.close()
    selected = epochs
    if best is not None:
        probe.load_state_dict(best[3])
        selected = best[2]
    return TrainResult(probe=probe.requires_grad_(False), epoch=selected, history=history)


def train_static(ts: TrajectorySet, mode: str, *, pca_dim: int = 256, c: float = 1.0, seed: int = 0,
                 max_pca_rows: int = 20000) -> Probe:
    """Thought Calibration's static probe: standardise, PCA, L2 logistic regression (C = 1).

    The fitted pipeline is affine up to the sigmoid, so it is folded into a linear probe with no
    online update: the server and replay run it with the same code as the TTT probes.
    """
    train = solvable(ts, ts.split(Split.TRAIN), mode)
    if not train:
        raise ValueError(f"the training split has no problem with a correct step under '{mode}'")
    return fit_static([ts.embeddings(i) for i in train], [ts.labels(i, mode) for i in train],
                      pca_dim=pca_dim, c=c, seed=seed, max_pca_rows=max_pca_rows)


def train_give_up(ts: TrajectorySet, mode: str, *, seed: int = 0) -> Probe:
    """The give-up probe (docs/METHOD.md section 9): a static probe fitted on EVERY training
    trajectory, each step labelled with whether a right answer lies at it or later under `mode`
    (a reference label mode, raw per-step labels: `right_ahead`), so its score estimates
    P(continuing can still reach a right answer | this step): what the give-up loss counts."""
    train = ts.split(Split.TRAIN)
    targets = [right_ahead(ts.raw_labels(i, mode)) for i in train]
    ahead = sum(int(t.sum()) for t in targets)
    if not train or ahead == 0 or ahead == sum(t.size for t in targets):
        raise ValueError(f"the training split needs steps with a right answer ahead and steps "
                         f"without under '{mode}' to fit a give-up probe ({ahead} of "
                         f"{sum(t.size for t in targets)} steps have one)")
    return fit_static([ts.embeddings(i) for i in train], [t.astype(float) for t in targets],
                      seed=seed)


def fit_static(embeddings: list[np.ndarray], targets: list[np.ndarray], *, pca_dim: int = 256,
               c: float = 1.0, seed: int = 0, max_pca_rows: int = 20000) -> Probe:
    """Standardise, PCA, L2 logistic regression of per-step 0/1 targets on step embeddings,
    folded into a static linear probe (`train_static`)."""
    rng = np.random.default_rng(seed)
    x = np.concatenate(embeddings).astype(np.float32)
    y = np.concatenate(targets).astype(np.float64)
    mean, std = x.mean(0), x.std(0) + 1e-6
    xs = torch.from_numpy((x - mean) / std)
    rows = rng.choice(len(xs), size=min(len(xs), max_pca_rows), replace=False)
    k = min(pca_dim, xs.shape[1], len(rows))
    _, _, v = torch.linalg.svd(xs[rows], full_matrices=False)
    comps = v[:k].T  # [d, k]
    z = (xs @ comps).double().numpy()
    w, b = _logistic_l2(z, y, c)
    w_eff = (comps.double().numpy() @ w) / std  # back to raw phi space
    probe = Probe(ProbeSpec(dim=x.shape[1], online=False))
    with torch.no_grad():
        probe.params["w"].copy_(torch.from_numpy(w_eff))
        probe.params["b"].fill_(float(b - w_eff @ mean))
    return probe.requires_grad_(False)


def _logistic_l2(z: np.ndarray, y: np.ndarray, c: float) -> tuple[np.ndarray, float]:
    """sklearn's objective 0.5 |w|^2 + C sum log-loss (bias unpenalised), by L-BFGS."""
    def f(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:-1], theta[-1]
        logit = z @ w + b
        loss = np.logaddexp(0, logit) - y * logit
        r = 1 / (1 + np.exp(-logit)) - y
        grad = np.concatenate([z.T @ r * c + w, [c * r.sum()]])
        return c * loss.sum() + 0.5 * w @ w, grad
    res = minimize(f, np.zeros(z.shape[1] + 1), jac=True, method="L-BFGS-B",
                   options={"maxiter": 500})
    return res.x[:-1], float(res.x[-1])


def save_probe(probe: Probe, path: Path, meta: dict | None = None) -> None:
    """A trained probe: slow weights plus its spec (and training facts) in safetensors metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in probe.params.items()}
    metadata = {"spec": probe.spec.to_json(), "format": "orca-probe-1"}
    metadata |= {k: str(v) for k, v in (meta or {}).items()}
    save_file(tensors, str(path), metadata=metadata)


def load_probe(path: Path) -> tuple[Probe, dict[str, str]]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"probe file {path} not found (or not a file)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f"{path} is not a probe file (safetensors): {e}") from None
    if meta.get("format") != "orca-probe-1":
        raise ValueError(f"{path} is not a probe written by `orca-calibrate train`")
    probe = Probe(ProbeSpec.from_dict(json.loads(meta["spec"])))
    tensors = load_file(str(path))
    probe.load_state_dict({f"params.{k}": v for k, v in tensors.items()})
    return probe.requires_grad_(False), meta


def train_probe(ts, probe: str, mode: str, *, d_h: int, seed: int, checkpoints: Path | None,
                progress: bool = True, **options):
    """Train one named probe; returns (probe, facts for the provenance).

    `options` are `meta_train` settings (epochs, batch_size, lr, warmup, epoch_select); those
    absent or None take `orca_calibrate.train.DEFAULTS` (epochs: 20 no-QK, 10 QK, as the paper).
    """
    if probe == "static":
        return train_static(ts, mode, seed=seed), {"probe": probe}
    opts = PROBES[probe]
    spec = ProbeSpec(dim=ts.dim, d_h=d_h if opts.get("kind") == Kind.QK else None, **opts)
    settings = training_settings(spec, options)
    res = meta_train(ts, spec, mode, seed=seed, checkpoints=checkpoints, progress=progress,
                     **settings)
    return res.probe, {"probe": probe, **settings, "selected_epoch": res.epoch,
                       "history": res.history}
