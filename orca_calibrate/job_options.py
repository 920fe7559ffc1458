"""A calibration's split, LTT and shift gate settings, typed and checked where they come in.

A job file's `split:` and `calibrate:` blocks (`calibrate.gate` included), `orca-calibrate
calibrate`'s flags and `orca-calibrate gate`'s, become
these frozen records once, with one-line errors, instead of dictionaries read with a default at
each use: a misspelt key (`delta:` for `deltas:`) or a delta outside (0, 1) used to fall back to
the defaults, or fail deep in LTT, without a word. Kept apart from orca_calibrate/calibrate.py
(torch) so that a job's check and `--help` need no torch. The defaults live here only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from orca_method.ltt import DEFAULT_EPSILON
from orca_method.shift_gate import (
    DEFAULT_GATE_ALPHA,
    DEFAULT_GATE_GIVE_UP_ALPHA,
    DEFAULT_GATE_RANK,
    DEFAULT_GATE_STEPS,
    give_up_level,
)
from orca_method.thresholds import MAX_WINDOW
from orca_method.trajectories import DEFAULT_FRACTIONS, SPLITS

DEFAULT_DELTAS = (0.05, 0.1, 0.15, 0.2)
DEFAULT_WINDOW = 10  # the smoothing window k the bundle records and the server uses
# `calibrate:` keys that are blocks of their own, checked by their own records (job.py)
CALIBRATE_BLOCKS = ("give_up", "groups", "consensus", "gate")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_whole(name: str, v: Any, least: int | None = None) -> None:
    """ValueError (one line, naming the setting) unless `v` is an integer >= `least`."""
    if isinstance(v, bool) or not isinstance(v, int) or (least is not None and v < least):
        at_least = "" if least is None else f" >= {least}"
        raise ValueError(f"{name} is a whole number{at_least}, got {v!r:.40}")


def check_number(name: str, v: Any, low: float, high: float, *, low_open: bool = False,
                 high_open: bool = False) -> None:
    """ValueError unless `v` is a finite number in [low, high] (an end left out when open)."""
    if (not _number(v) or not (low < v if low_open else low <= v)
            or not (v < high if high_open else v <= high)):
        where = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} is a number in {where}, got {v!r:.40}")


@dataclass(frozen=True)
class LttOptions:
    """The risk levels LTT certifies, its level epsilon and the smoothing window."""

    deltas: tuple[float, ...] = DEFAULT_DELTAS
    epsilon: float = DEFAULT_EPSILON
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if not self.deltas or not all(_number(d) and 0 < d < 1 for d in self.deltas):
            raise ValueError(f"deltas are risk levels in (0, 1), got {list(self.deltas)!r:.80}")
        if len(set(self.deltas)) < len(self.deltas):
            raise ValueError(f"deltas are listed once each, got {list(self.deltas)}")
        if not (_number(self.epsilon) and 0 < self.epsilon < 1):
            raise ValueError(f"epsilon is in (0, 1), got {self.epsilon!r:.40}")
        w = self.window
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_WINDOW:
            raise ValueError(f"window is a whole number of steps in [1, {MAX_WINDOW}], "
                             f"got {w!r:.40}")


@dataclass(frozen=True)
class SplitOptions:
    """How a job's trajectories are split into train / calibration / test (by prompt)."""

    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    seed: int = 0

    def __post_init__(self) -> None:
        f = self.fractions
        if (len(f) != len(SPLITS) or not all(_number(x) and x >= 0 for x in f)
                or not math.isclose(sum(f), 1)):
            raise ValueError(f"fractions are {len(SPLITS)} non-negative numbers "
                             f"({', '.join(SPLITS)}) summing to 1, got {list(f)!r:.80}")
        if not (f[0] > 0 and f[1] > 0):  # found after collection (hours), or after training
            raise ValueError(f"fractions give the train and the calibration split a share each "
                             f"(the probe is trained on one, lambda* certified on the other), "
                             f"got {list(f)!r:.80}")
        check_whole("seed", self.seed, 0)


@dataclass(frozen=True)
class GateOptions:
    """The shift gate a calibration fits (docs/METHOD.md section 11): the step embeddings it reads
    (it decides at that step), its levels for stops (`alpha`) and give-ups, and the principal
    directions of its score. A reasoner whose first step says little of its prompt's family is
    told apart better on more steps (the long demo's: 2 steps, rank 64)."""

    steps: int = DEFAULT_GATE_STEPS
    alpha: float = DEFAULT_GATE_ALPHA
    # None: DEFAULT_GATE_GIVE_UP_ALPHA, or alpha where that is higher (`fitted_give_up_alpha`)
    give_up_alpha: float | None = None
    rank: int = DEFAULT_GATE_RANK

    def __post_init__(self) -> None:
        check_whole("steps", self.steps, 1)
        check_whole("rank", self.rank, 1)
        check_number("alpha", self.alpha, 0, 1, low_open=True, high_open=True)
        if self.give_up_alpha is not None:
            check_number("give_up_alpha", self.give_up_alpha, 0, 1, low_open=True, high_open=True)
            give_up_level(self.alpha, self.give_up_alpha)

    @property
    def fitted_give_up_alpha(self) -> float:
        """The give-up side's level the gate is fitted with."""
        if self.give_up_alpha is None:
            return max(self.alpha, DEFAULT_GATE_GIVE_UP_ALPHA)
        return self.give_up_alpha


def _record(cls: type, block: Mapping[str, Any] | None, name: str,
            skip: tuple[str, ...] = ()) -> Any:
    """`cls` from a job file's block; ValueError names the block and the key."""
    if block is not None and not isinstance(block, Mapping):
        raise ValueError(f"{name} is a mapping of settings, got {block!r:.40}")
    block = block or {}
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(block) - set(known) - set(skip))
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown} (known: {', '.join(known + list(skip))})")
    values = {k: v for k, v in block.items() if k in known}
    for k, v in values.items():
        if isinstance(v, list):
            values[k] = tuple(v)
        elif k in ("deltas", "fractions") and not isinstance(v, tuple):
            raise ValueError(f"{name}.{k} is a list, got {v!r:.40}")
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def ltt_options(block: Mapping[str, Any] | None) -> LttOptions:
    """A job's `calibrate:` block's LTT settings (its sub-blocks are checked on their own)."""
    return _record(LttOptions, block, "calibrate", skip=CALIBRATE_BLOCKS)


def split_options(block: Mapping[str, Any] | None) -> SplitOptions:
    """A job's `split:` block."""
    return _record(SplitOptions, block, "split")


def gate_options(block: Mapping[str, Any] | None) -> GateOptions:
    """A job's `calibrate.gate:` block."""
    return _record(GateOptions, block, "calibrate.gate")
