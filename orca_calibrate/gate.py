"""The bundle's shift gate (orca_method/shift_gate.py, docs/METHOD.md section 11), built offline.

Two ways in:
- `gate_from_trajectories`: from the job's own trajectory set (the calibrate stage does this):
  fitted on the training split's first steps, scored on the calibration split's.
- `orca-calibrate gate` (`add_gate`): for a bundle that has none (an older bundle, an imported
  probe), from fresh in-distribution prompts run only as far as the gate reads (their first
  steps, in record mode: the plugin's own embeddings, so the features are the server's). Cheap:
  a few dozen tokens per prompt instead of a whole trace.

The p-values are valid for requests exchangeable with the scored (calibration) prompts; the
fitted half may be anything, which is why the two halves must be different prompts.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from orca_calibrate.job_options import GateOptions
from orca_method.bundle import (
    Bundle,
    GateReference,
    decode_weights,
    gate_reference,
    load_bundle,
    save_bundle,
)
from orca_method.shift_gate import gate_features
from orca_method.trajectories import Split, TrajectorySet

if TYPE_CHECKING:
    from orca_calibrate.collect import Collector


def gate_features_of(embeddings: Sequence[np.ndarray], steps: int) -> np.ndarray:
    rows = [f for f in (gate_features(e, steps) for e in embeddings) if f is not None]
    return np.stack(rows) if rows else np.empty((0, 0))


def gate_from_trajectories(ts: TrajectorySet, opts: GateOptions = GateOptions()
                           ) -> GateReference | None:
    """The gate fitted on the training split and scored on the calibration split (None when
    either has too few trajectories long enough to be gated)."""
    fit = gate_features_of([ts.embeddings(i) for i in ts.split(Split.TRAIN)], opts.steps)
    cal = gate_features_of([ts.embeddings(i) for i in ts.split(Split.CALIBRATION)], opts.steps)
    if len(fit) < 2 or len(cal) < 1:
        return None
    return _reference(fit, cal, opts)


def _reference(fit: np.ndarray, cal: np.ndarray, opts: GateOptions) -> GateReference:
    return gate_reference(fit, cal, steps=opts.steps, alpha=opts.alpha,
                          give_up_alpha=opts.fitted_give_up_alpha, rank=opts.rank)


def options_of(ref: GateReference) -> GateOptions:
    """The settings a bundle's gate was fitted with (its rank: the directions it kept; a gate
    of one level, from before the give-up side had its own, keeps one)."""
    rank = int(decode_weights(ref.tensors, "shift gate tensors")["basis"].shape[0])
    return GateOptions(steps=ref.steps, alpha=ref.alpha, rank=rank,
                       give_up_alpha=ref.alpha if ref.give_up_alpha is None else ref.give_up_alpha)


def gate_from_features(features: np.ndarray, opts: GateOptions, *, fit_fraction: float,
                       seed: int) -> GateReference:
    """A gate fitted on a seeded part of `features` ([N, d]) and scored on the rest; ValueError
    when they are too few."""
    fit, cal = split_features(features, fit_fraction, seed)
    if len(fit) < 2 or len(cal) < 1:
        raise ValueError(f"{len(features)} usable prompts are too few for a gate (fitted "
                         f"{len(fit)}, scored {len(cal)}); give more prompts")
    return _reference(fit, cal, opts)


def split_features(features: np.ndarray, fit_fraction: float, seed: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """A seeded split of the features into the fitted part and the scored part."""
    order = np.random.default_rng(seed).permutation(len(features))
    k = int(round(fit_fraction * len(features)))
    return features[order[:k]], features[order[k:]]


def gate_collector(model: str, bundle: Bundle, *, max_tokens: int, temperature: float,
                   seed: int, engine: dict[str, Any]) -> Collector:
    """A record-mode engine with the bundle's segmentation, think tags and normalisation, that
    runs each prompt for `max_tokens` (enough for the gate's steps + 1), sampling at
    `temperature` with the top_p, top_k and min_p of the bundle's calibration traces
    (`collected_under`; none recorded: none), as the traffic the gate is for is sampled when
    served as calibrated."""
    from orca_calibrate.collect import CollectSettings, Collector  # deferred: vLLM

    under = bundle.collected_under()
    sampling = {} if under is None else {"top_p": under.top_p, "top_k": under.top_k,
                                         "min_p": under.min_p}
    settings = CollectSettings(
        temperature=temperature, max_tokens=max_tokens, seed=seed, batch=256, **sampling,
        segmentation=bundle.segmentation.model_dump(), think=bundle.think.model_dump(),
        normalization=bundle.normalization, engine=engine)
    return Collector(model, settings)


def first_step_features(collector: Collector, prompts: list[dict], steps: int) -> np.ndarray:
    """Gate features of `prompts` ([N, d]). Prompts whose output ends before step `steps` + 1
    are left out (noted), as the server never gates them."""
    records = collector.record(prompts)
    feats = gate_features_of([np.asarray(r["step_embeddings"]) for r in records
                       if r.get("step_embeddings") is not None], steps)
    if len(feats) < len(prompts):
        print(f"note: {len(prompts) - len(feats)} of {len(prompts)} prompts ended before step "
              f"{steps + 1} within {collector.settings.max_tokens} tokens; left out",
              file=sys.stderr)
    return feats


def add_gate(bundle_path: Path, out: Path, features: np.ndarray, opts: GateOptions, *,
             fit_fraction: float, seed: int) -> Bundle:
    """The bundle with a gate fitted on part of `features` and scored on the rest, re-sealed."""
    bundle = load_bundle(bundle_path)
    if features.shape[1] != bundle.model.hidden_size:
        raise ValueError(f"features have width {features.shape[1]}, the bundle's model "
                         f"{bundle.model.hidden_size}")
    ref = gate_from_features(features, opts, fit_fraction=fit_fraction, seed=seed)
    return save_bundle(bundle.model_copy(update={"shift_gate": ref}), out)
