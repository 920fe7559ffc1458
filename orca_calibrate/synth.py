"""Synthetic trajectory sets: exercise the whole calibration pipeline without a model or GPU.

The model, per problem p with T steps t = 0..T-1 (before normalisation):

    x_t = mu_p + (t / (T-1)) * drift * w_p + a_t * v + noise_t,      phi_t = x_t / ||x_t||

- ``mu_p``: a per-problem offset of large norm (about ``offset_scale``), partly aligned with v
  (cosine ~ N(0, ``offset_along_v``)). It is the problem-specific baseline: an online probe
  that updates towards "not yet" on the current problem can cancel it, a static probe cannot.
- ``w_p``: a linear drift direction across the trajectory, mixing a direction shared by all
  problems (reasoning "progresses" alike) with a per-problem one.
- ``v``: a shared "solved" direction. From the latent breakthrough step b_p on, its strength
  ``a_t`` ramps from 0 to ``signal`` over ``ramp`` steps; while the current answer is wrong
  after b_p (a temporary flip, or a wrong final answer) it drops to 30 %.
- ``noise_t``: isotropic Gaussian, norm about ``noise``. Steps are independent given the
  latent state (offset, drift position, answer state).
- b_p ~ T * Beta(a, b); with probability ``p_never`` a problem never breaks through.
- step embeddings are L2-normalised per step (``normalization = "step-l2"``).

Answers are integers as strings. Before b_p the current answer wanders through a pool of
three wrong answers; from b_p on it is the reference answer, except a temporary flip of 1-3
steps (probability ``p_flip``) and, with probability ``p_final_wrong``, a switch to a wrong
answer that lasts to the end. Labels: supervised = current answer is correct; consistent =
current answer equals the final one. Both are raw (not monotone); cumulate them to use.

Families: "shifted" has larger and more v-aligned offsets, twice the drift, a weaker and
slower signal and earlier breakthroughs (Beta(1, 3) instead of uniform), so a static probe's
scores and thresholds transfer worse to it.

What it does NOT model: language, tokens or real segmentation (step token counts are iid
uniform 20-80), answer extraction, any dependence between steps beyond the latent state,
the geometry of real hidden states (one signal direction, isotropic noise), "settling" on a
wrong answer being visible in the embeddings (consistent labels of unsolved problems have no
signal of their own), prompts sampled several times, heavy-tailed lengths.

The shared directions depend only on ``dim``; per-problem draws only on (seed, family, index),
and scalars are drawn before vectors, so latents (steps, labels) do not depend on ``dim``.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from orca_calibrate.progress import progress_bar
from orca_method.trajectories import (
    DTYPES,
    EMBEDDINGS_FILE,
    STORED_DTYPE,
    TrajectoryWriter,
    split_ids,
)

FLIP_SIGNAL = 0.3  # share of the signal left while the current answer is wrong after b_p
N_WRONG = 3  # size of the pool of wrong answers per problem
_WORLD_SEED = 0x0C7A


@dataclass(frozen=True)
class Family:
    """Distribution parameters of one problem family (see the module docstring)."""

    offset_scale: float
    offset_along_v: float
    drift: float
    signal: float
    ramp: int
    breakthrough: tuple[float, float]
    p_never: float
    p_flip: float
    p_final_wrong: float
    noise: float


FAMILIES = {
    "in-dist": Family(offset_scale=3.0, offset_along_v=0.25, drift=1.0, signal=1.5, ramp=4,
                      breakthrough=(1.0, 1.0), p_never=0.15, p_flip=0.2, p_final_wrong=0.08,
                      noise=1.0),
    "shifted": Family(offset_scale=4.5, offset_along_v=0.4, drift=2.0, signal=1.0, ramp=6,
                      breakthrough=(1.0, 3.0), p_never=0.10, p_flip=0.2, p_final_wrong=0.08,
                      noise=1.0),
}


@dataclass(frozen=True)
class World:
    """Directions shared by all problems and families of a given dim."""

    v: np.ndarray  # the "solved" direction
    s: np.ndarray  # the shared drift direction, orthogonal to v


def world(dim: int) -> World:
    """The shared directions; fixed per dim so in-dist and shifted sets share one "model"."""
    rng = np.random.default_rng([_WORLD_SEED, dim])
    v = _unit(rng.standard_normal(dim))
    return World(v=v, s=_unit(_orthogonal(rng.standard_normal(dim), v)))


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


def _orthogonal(x: np.ndarray, v: np.ndarray) -> np.ndarray:
    return x - (x @ v) * v


def _answers(rng: np.random.Generator, fam: Family, n: int, b: int | None
             ) -> tuple[str, np.ndarray]:
    """Reference answer and the current answer at every step."""
    pool = rng.choice(np.arange(1, 1000), size=N_WRONG + 1, replace=False).astype(str)
    answer, wrong = pool[0], pool[1:]
    segment = np.cumsum(rng.random(n) < 0.2)
    current = wrong[rng.integers(0, N_WRONG, size=segment[-1] + 1)[segment]]
    if b is not None:
        current[b:] = answer
        flip, final = rng.random(2)
        if flip < fam.p_flip and b + 1 < n:
            start = int(rng.integers(b + 1, n))
            current[start:start + int(rng.integers(1, 4))] = wrong[0]
        if final < fam.p_final_wrong and b + 1 < n:
            current[int(rng.integers(b + 1, n)):] = wrong[1]
    return str(answer), current


def _problem(rng: np.random.Generator, fam: Family, w: World, mean_steps: float
             ) -> tuple[dict[str, Any], np.ndarray]:
    """Problem fields (without id/split) and float32 unit-norm step embeddings."""
    n = int(np.clip(round(mean_steps * rng.lognormal(-0.125, 0.5)), 2, 4 * mean_steps))
    b = None if rng.random() < fam.p_never else min(int(n * rng.beta(*fam.breakthrough)), n - 1)
    answer, current = _answers(rng, fam, n, b)
    correct = current == answer
    strength = np.zeros(n, np.float32)
    if b is not None:
        strength[b:] = fam.signal * np.minimum(1.0, (np.arange(n - b) + 1) / fam.ramp)
        strength[b:] *= np.where(correct[b:], 1.0, FLIP_SIGNAL)
    radius = fam.offset_scale * rng.lognormal(0.0, 0.25)
    cos_v = float(np.clip(rng.normal(0.0, fam.offset_along_v), -0.9, 0.9))
    tokens = rng.integers(20, 81, size=n)
    dim = len(w.v)
    # Vectors last, so the scalar latents above do not depend on dim.
    u = _unit(_orthogonal(rng.standard_normal(dim), w.v))
    mu = radius * (cos_v * w.v + np.sqrt(1 - cos_v**2) * u)
    drift_dir = _unit(0.6 * w.s + 0.8 * _unit(rng.standard_normal(dim)))
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x *= fam.noise / np.sqrt(dim)
    x += mu.astype(np.float32)
    x += np.outer(np.linspace(0.0, fam.drift, n, dtype=np.float32), drift_dir.astype(np.float32))
    x += np.outer(strength, w.v.astype(np.float32))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    fields = {
        "answer": answer,
        "step_tokens": tokens.tolist(),
        "step_answers": current.tolist(),
        "final_answer": str(current[-1]),
        "labels": {"supervised": correct.astype(int).tolist(),
                   "consistent": (current == current[-1]).astype(int).tolist()},
        "extra": {"breakthrough": b, "final_correct": bool(current[-1] == answer)},
    }
    return fields, x


def disk_room(out_dir: str | Path, n_problems: int, dim: int, mean_steps: int, dtype: str
              ) -> tuple[int, int]:
    """(About the bytes the set's step embeddings still need, the bytes free on the filesystem
    of ``out_dir``), to refuse before writing a set the disk cannot hold: it is written problem
    by problem until the disk is full otherwise. Problems have ``mean_steps`` steps on average
    (`_problem`'s lognormal factor has mean 1); a resumed set needs what it has not written."""
    out = Path(out_dir).absolute()
    total = n_problems * mean_steps * dim * DTYPES[dtype].itemsize
    written = out / EMBEDDINGS_FILE
    left = total - (written.stat().st_size if written.is_file() else 0)
    existing = next(p for p in (out, *out.parents) if p.exists())  # out need not exist yet
    return max(left, 0), shutil.disk_usage(existing).free


def generate(out_dir: str | Path, n_problems: int = 600, dim: int = 64, shift: bool = False,
             seed: int = 0, mean_steps: int = 100, dtype: str = STORED_DTYPE,
             splits: Sequence[float] | None = (0.6, 0.2, 0.2)) -> Path:
    """Write a synthetic trajectory directory, problem by problem (resumable; see module doc).

    ``shift`` selects the "shifted" family instead of "in-dist". Splits are assigned per
    problem with ``split_ids(ids, splits, seed)``; ``splits=None`` assigns none, as the
    server's audits have none (what the audit tools read).
    """
    return generate_mixture(out_dir, {"shifted" if shift else "in-dist": n_problems}, dim=dim,
                            seed=seed, mean_steps=mean_steps, dtype=dtype, splits=splits)


def generate_mixture(out_dir: str | Path, counts: Mapping[str, int], dim: int = 64,
                     seed: int = 0, mean_steps: int = 100, dtype: str = STORED_DTYPE,
                     splits: Sequence[float] | None = (0.6, 0.2, 0.2)) -> Path:
    """`generate` for a mixture: ``counts[family]`` problems of each family in one set, each
    tagged with its `family` (what group-conditional calibration groups by), its problems those
    `generate` would draw for that family alone; splits over the whole set."""
    plan = [(family, p) for family, n in counts.items() for p in range(n)]
    unknown = sorted(set(counts) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    w = world(dim)
    ids = [f"synth-{family}-{seed}-{p:06d}" for family, p in plan]
    assignment = {} if splits is None else split_ids(ids, splits, seed)
    what = " ".join(f"family={f} n_problems={n}" for f, n in counts.items())
    shown = None if splits is None else tuple(splits)
    source = f"synth v1: {what} seed={seed} mean_steps={mean_steps} splits={shown}"
    with TrajectoryWriter(out_dir, dim, dtype, model="synthetic", normalization="step-l2",
                          source=source) as writer:
        done = writer.ids
        big = len(plan) * mean_steps * dim >= 5e7
        shown_plan = progress_bar(plan, desc=f"synth {what}", disable=not big)
        for (family, p), pid in zip(shown_plan, ids):
            if pid in done:
                continue
            rng = np.random.default_rng([seed, 1 if family == "shifted" else 0, p])
            fields, emb = _problem(rng, FAMILIES[family], w, mean_steps)
            writer.append({"id": pid, "prompt": f"synthetic {family} problem {p} (seed {seed})",
                           "split": assignment.get(pid), "family": family, **fields}, emb)
    return Path(out_dir)
