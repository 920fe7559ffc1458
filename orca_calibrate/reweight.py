"""`orca-calibrate reweight`: a bundle's lambda* recertified for today's traffic, without labels.

The method is orca_method/covariate_shift.py (docs/METHOD.md section 13): a classifier tells the
job's training split from the traffic by their gate features, its density ratio re-draws the
calibration split towards the traffic (rejection sampling), and LTT runs unchanged on the traces
kept, through the calibrate stage's own code (`calibrate_bundle`), so the new bundle is written,
checked and sealed as every other. What it needs:
- the bundle's job directory: `bundle.json` and `trajectories/` with its train and calibration
  splits (their step embeddings give the gate features; their labels the losses);
- the traffic's gate features, [N, d]: a `.npy` file, or prompts run only as far as the gate
  reads (`traffic_features_from_prompts`: record mode, the plugin's own embeddings, as
  `orca-calibrate gate` does). No label of the traffic is read.

The new bundle records what it was reweighted to in its provenance (`reweight`); its schema is
the parent's, so every reader that loads the parent loads it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from orca_calibrate.calibrate import calibrate_bundle
from orca_method.bundle import Bundle, load_bundle
from orca_method.covariate_shift import DEFAULT_RATIO_RANK, Resample, fit_density_ratio, resample
from orca_method.risk import is_solvable
from orca_method.shift_gate import DEFAULT_GATE_STEPS, gate_features
from orca_method.trajectories import TrajectorySet


def gate_steps(bundle: Bundle) -> int:
    """The steps the features are read at: the bundle's gate's, so that an operator's features
    of live requests (what the gate sees) are the same vectors."""
    return bundle.shift_gate.steps if bundle.shift_gate is not None else DEFAULT_GATE_STEPS


def features_of(ts: TrajectorySet, members: Sequence[int], steps: int
                ) -> tuple[list[int], np.ndarray]:
    """The problems of `members` that have gate features, and those features ([n, d]). A trace
    too short to have them (its reasoning ended before the gate's step) is left out: the server
    never stops one (it never scores a trace's last step), so its loss is 0 at every lambda and
    leaving it out only raises the risk LTT sees."""
    idx, rows = [], []
    for i in members:
        f = gate_features(ts.embeddings(i), steps)
        if f is not None:
            idx.append(i)
            rows.append(f)
    return idx, np.stack(rows) if rows else np.empty((0, ts.dim))


def read_traffic_features(path: Path, dim: int) -> np.ndarray:
    """An operator's traffic features: a `.npy` array [N, d] of finite numbers."""
    try:
        x = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read traffic features {path}: {e} (a .npy array [N, d])") \
            from None
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"traffic features {path} are {x.shape}, the bundle's model needs "
                         f"[N, {dim}]")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"traffic features {path} hold non-finite values")
    return x.astype(np.float64)


def _fingerprint(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x, dtype=np.float64).tobytes()).hexdigest()


def reweight_bundle(job: Path, traffic: np.ndarray, out: Path, *, source: str, seed: int = 0,
                    rank: int = DEFAULT_RATIO_RANK, clip: float | None = None
                    ) -> tuple[Bundle, Resample]:
    """The job's bundle recertified for traffic with these gate features ([N, d]): LTT on the
    calibration traces rejection sampling kept, the probe, window, deltas, epsilon and p-value
    kind the parent's. The give-up block is kept as calibrated (in distribution: the weights
    recertify lambda* only), as `recalibrate` keeps it; a group table is dropped (a group's
    traces are not what the weights re-draw). ValueError when no solvable trace is kept: the
    traffic lies outside what the calibration set can speak for, and only labels can say more
    (the live audit, `orca-calibrate recalibrate`)."""
    parent = load_bundle(job / "bundle.json")
    ts = TrajectorySet.open(job / "trajectories")
    if ts.dim != parent.model.hidden_size or traffic.shape[1] != ts.dim:
        raise ValueError(f"dimensions differ: bundle {parent.model.hidden_size}, job "
                         f"trajectories {ts.dim}, traffic features {traffic.shape[1]}")
    steps = gate_steps(parent)
    _, ref = features_of(ts, ts.split("train"), steps)
    cal_idx, cal = features_of(ts, ts.split("calibration"), steps)
    if not len(cal_idx):
        raise ValueError(f"{ts.path} has no calibration trace with gate features "
                         f"(step {steps} + 1)")
    ratio = fit_density_ratio(ref, traffic, rank=rank, seed=seed)
    rs = resample(ratio, cal, np.vstack([ref, traffic]), seed=seed, clip=clip)
    kept = [i for i, k in zip(cal_idx, rs.kept) if k]
    mode = parent.label_mode
    if not any(is_solvable(ts.labels(i, mode)) for i in kept):
        raise ValueError(
            f"the weights kept {len(kept)} of {len(cal_idx)} calibration traces and none with a "
            f"right step (B {rs.bound:.3g}, mean calibration weight {rs.weights.mean():.3g}, "
            f"n_eff {rs.n_eff:.1f}): the traffic lies outside what the calibration set can "
            "speak for; recalibrate on labelled audits instead (orca-calibrate recalibrate)")
    view = _view(ts, ts.split("train"), kept)
    provenance: dict[str, Any] = {
        "calibration_source": "the parent's calibration split, reweighted to the traffic "
                              "(covariate shift, docs/METHOD.md section 13)",
        "parent_checksum": parent.checksum,
        "reweight": {"traffic": source, "traffic_sha256": _fingerprint(traffic),
                     "n_traffic": len(traffic), "n_ref": len(ref), "gate_steps": steps,
                     "ratio_rank": int(ratio.basis.shape[0]), "ratio_l2": ratio.l2,
                     **rs.facts()}}
    if parent.give_up is not None:
        provenance["give_up"] = "the parent bundle's, kept as calibrated (in distribution)"
    bundle = calibrate_bundle(parent.load_probe(), view, out, mode=mode,
                              deltas=parent.deltas(), epsilon=parent.ltt.epsilon,
                              pvalue=parent.ltt.pvalue, window=parent.window,
                              default_delta=parent.default_delta, provenance=provenance,
                              give_up=parent.give_up)
    return bundle, rs


def _view(ts: TrajectorySet, train: Sequence[int], calibration: Sequence[int]) -> TrajectorySet:
    """The training split and the kept calibration traces as a set of their own (no copy of the
    embeddings): the calibrate stage replays the kept ones and fits the new bundle's gate on
    the training split, scored on the kept ones (its p-values are then for requests like them)."""
    idx = [*train, *calibration]
    problems = [replace(ts.problems[i], split="train" if k < len(train) else "calibration")
                for k, i in enumerate(idx)]
    return TrajectorySet(ts.path, ts.info, problems, [ts.embeddings(i) for i in idx])
