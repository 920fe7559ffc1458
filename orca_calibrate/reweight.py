"""`orca-calibrate reweight`: a bundle's lambda* recertified for today's traffic, without labels.

The method is orca_method/covariate_shift.py (docs/METHOD.md section 13): a classifier tells the
job's training split from the traffic by their gate features, its density ratio re-draws the
calibration split towards the traffic (rejection sampling), and LTT runs unchanged on the traces
kept, through the calibrate stage's own code (`calibrate_bundle`), so the new bundle is written,
checked and sealed as every other. What it needs:
- the bundle's job directory: `bundle.json` and `trajectories/` with its train and calibration
  splits (their step embeddings give the gate features; their labels the losses);
- the traffic's gate features, [N, d]: a `.npy` file, or prompts run only as far as the gate
  reads (`--traffic-prompts`: record mode, the plugin's own embeddings, as
  `orca-calibrate gate` does), or a server's audit directory (the step embeddings it records
  for a uniform sample of requests). No label of the traffic is read.

The population certified is the traffic the bundle's gate passes: the gate serves the rest with
its safe action, so the weights never need to speak for requests the calibration set does not
cover. The new bundle records what it was reweighted to in its provenance (`reweight`); its
schema is the parent's, so every reader that loads the parent loads it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from orca_calibrate.calibrate import GiveUpOptions, calibrate_bundle, parent_groups
from orca_method.bundle import Bundle, GiveUpBlock, load_bundle, save_bundle
from orca_method.covariate_shift import (
    CV_FOLDS,
    DEFAULT_RATIO_RANK,
    DensityRatio,
    Resample,
    fit_density_ratio,
    resample,
)
from orca_method.probe import Probe
from orca_method.risk import is_solvable
from orca_method.shift_gate import DEFAULT_GATE_STEPS, gate_features
from orca_method.trajectories import Split, TrajectorySet


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


def gate_passes(bundle: Bundle, x: np.ndarray) -> np.ndarray:
    """[n] bool: which of these gate features ([n, d]) the bundle's gate passes at its default
    alpha (all, for a bundle without a gate). The flagged ones are served by the gate's safe
    action (full reasoning by default: loss 0), so the weights need to speak for the rest only."""
    gate = bundle.load_gate()
    if gate is None or not len(x):
        return np.ones(len(x), dtype=bool)
    import torch  # deferred: the CLI's --help needs no torch

    scores = gate.score(torch.from_numpy(np.asarray(x, dtype=np.float32))).numpy()  # [n]
    return ~(scores > gate.threshold(gate.alpha))


@dataclass(frozen=True)
class Draw:
    """One reweighting: which traffic requests and calibration traces the gate passes ([N] and
    [n] bool), the ratio fitted on the passing ones, and rejection sampling over the passing
    calibration traces (`resample.kept` indexes those)."""

    traffic_passes: np.ndarray
    cal_passes: np.ndarray
    ratio: DensityRatio
    resample: Resample
    n_ref: int


def draw(parent: Bundle, ref: np.ndarray, cal: np.ndarray, traffic: np.ndarray, *, seed: int,
         rank: int = DEFAULT_RATIO_RANK, clip: float | None = None) -> Draw:
    """The reweighting of `reweight_bundle` on features alone (reference [n0, d], calibration
    [n, d], traffic [N, d]): everything restricted to what the parent's gate passes, the ratio
    fitted reference-vs-traffic, the passing calibration traces drawn towards the traffic.
    ValueError when fewer than CV_FOLDS traffic requests pass."""
    ref = ref[gate_passes(parent, ref)]
    passing = gate_passes(parent, traffic)
    if passing.sum() < CV_FOLDS:
        raise ValueError(f"the bundle's gate flags {int((~passing).sum())} of {len(traffic)} "
                         "traffic requests: they are served by its safe action, and too few "
                         "pass to reweight for")
    cal_in = gate_passes(parent, cal)
    ratio = fit_density_ratio(ref, traffic[passing], rank=rank, seed=seed)
    rs = resample(ratio, cal[cal_in], np.vstack([ref, traffic[passing]]), seed=seed, clip=clip)
    return Draw(traffic_passes=passing, cal_passes=cal_in, ratio=ratio, resample=rs,
                n_ref=len(ref))


def reweight_bundle(job: Path, traffic: np.ndarray, out: Path, *, source: str, seed: int = 0,
                    rank: int = DEFAULT_RATIO_RANK, clip: float | None = None
                    ) -> tuple[Bundle, Resample]:
    """The job's bundle recertified for traffic with these gate features ([N, d]).

    The population certified is the traffic the bundle's gate passes (at its default alpha; the
    rest gets the gate's safe action): `draw` restricts the reference, calibration and traffic
    features to what the gate passes, fits the ratio and keeps calibration traces, and LTT runs
    on the kept ones (the calibrate stage's code) with the parent's probe, window, deltas,
    epsilon and p-value kind. The new bundle keeps the parent's gate as it is (the same requests
    pass it online) and its group tables (`parent_groups`: a group's traces are not what the
    weights re-draw, and its table holds as calibrated). mu* of a two-sided bundle is
    recertified on the kept traces too (`_give_up`). ValueError when the gate flags (nearly)
    all the traffic (nothing to reweight for) or when no solvable trace is kept: the traffic lies outside what the
    calibration set can speak for, and only labels can say more (`orca-calibrate recalibrate`)."""
    parent = load_bundle(job / "bundle.json")
    ts = TrajectorySet.open(job / "trajectories")
    if ts.dim != parent.model.hidden_size or traffic.shape[1] != ts.dim:
        raise ValueError(f"dimensions differ: bundle {parent.model.hidden_size}, job "
                         f"trajectories {ts.dim}, traffic features {traffic.shape[1]}")
    steps = gate_steps(parent)
    _, ref = features_of(ts, ts.split(Split.TRAIN), steps)
    cal_idx, cal = features_of(ts, ts.split(Split.CALIBRATION), steps)
    if not cal_idx:
        raise ValueError(f"{ts.path} has no calibration trace with gate features (step "
                         f"{steps} + 1)")
    d = draw(parent, ref, cal, traffic, seed=seed, rank=rank, clip=clip)
    rs = d.resample
    passed = [i for i, k in zip(cal_idx, d.cal_passes) if k]
    kept = [i for i, k in zip(passed, rs.kept) if k]
    mode = parent.label_mode
    if not any(is_solvable(ts.labels(i, mode)) for i in kept):
        raise ValueError(
            f"the weights kept {len(kept)} of {len(passed)} calibration traces and none with a "
            f"right step (B {rs.bound:.3g}, mean calibration weight {rs.weights.mean():.3g}, "
            f"n_eff {rs.n_eff:.1f}): the traffic lies outside what the calibration set can "
            "speak for; recalibrate on labelled audits instead (orca-calibrate recalibrate)")
    provenance: dict[str, Any] = {
        "calibration_source": "the parent's calibration split, reweighted to the traffic its "
                              "gate passes (covariate shift, docs/METHOD.md section 13)",
        "parent_checksum": parent.checksum,
        "reweight": {"traffic": source, "traffic_sha256": _fingerprint(traffic),
                     "n_traffic": len(traffic), "n_traffic_passed": int(d.traffic_passes.sum()),
                     "n_ref": d.n_ref, "gate_steps": steps,
                     "ratio_rank": int(d.ratio.basis.shape[0]), "ratio_l2": d.ratio.l2,
                     **rs.facts()}}
    give_up = _give_up(parent, ts)
    groups, said = parent_groups(parent, same_probe=True)
    provenance.update(said)
    if parent.give_up is not None:
        provenance["give_up"] = ("recertified on the kept traces, its probe the parent's"
                                 if isinstance(give_up, tuple) else "the parent bundle's, kept "
                                 f"as calibrated (in distribution: {ts.path} has no "
                                 f"'{parent.give_up.label_mode}' labels to recertify it on)")
    fresh = calibrate_bundle(parent.load_probe(), _view(ts, ts.split(Split.TRAIN), kept), out,
                             mode=mode, deltas=parent.deltas(), epsilon=parent.ltt.epsilon,
                             pvalue=parent.ltt.pvalue, window=parent.window,
                             default_delta=parent.default_delta, provenance=provenance,
                             give_up=give_up, groups=groups)
    # the parent's gate, as it is: the population certified is the traffic it passes
    return save_bundle(fresh.model_copy(update={"shift_gate": parent.shift_gate}), out), rs


def _give_up(parent: Bundle, ts: TrajectorySet
             ) -> tuple[Probe, GiveUpOptions] | GiveUpBlock | None:
    """How the new bundle's give-up side is made: mu* recertified on the kept traces (the give-up
    risk is over every request, and the same weights re-draw every trace), with the parent's
    give-up probe and settings, when the job's traces carry its reference labels; else the
    parent's block as calibrated. The give-up loss needs the same assumption as the stop loss:
    unchanged given the features."""
    g = parent.give_up
    if g is None or g.label_mode not in ts.label_modes:
        return g
    opts = GiveUpOptions(label_mode=g.label_mode, deltas=tuple(parent.give_up_deltas()),
                         epsilon=g.ltt.epsilon, window=g.window, default_delta=g.default_delta,
                         policy=g.policy)
    return parent.load_give_up_probe(), opts


def _view(ts: TrajectorySet, train: Sequence[int], calibration: Sequence[int]) -> TrajectorySet:
    """The training split and the kept calibration traces as a set of their own (no copy of the
    embeddings), for the calibrate stage to replay the kept ones."""
    idx = [*train, *calibration]
    problems = [replace(ts.problems[i], split=Split.TRAIN if k < len(train) else Split.CALIBRATION)
                for k, i in enumerate(idx)]
    return TrajectorySet(ts.path, ts.info, problems, [ts.embeddings(i) for i in idx])
