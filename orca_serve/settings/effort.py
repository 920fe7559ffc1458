"""`reasoning_effort` -> a calibrated risk level: the one table, its parser and its resolution.

Reasoning clients already say how hard the model should think: chat's `reasoning_effort`, the
Responses API's `reasoning.effort`, the Messages API's `output_config.effort`. Early stopping
turns that into the risk level delta it stops at. The table maps each effort level to

- `largest` / `default` / `smallest`: the bundle's largest delta, its `default_delta`, its
  smallest delta (resolved against the bundle that serves the request, so a hot reload keeps the
  meaning), or a number: that delta (it must be in every bundle served);
- `off`: no early stopping for the request (orca disabled: the model reasons to its end).

Default: minimal, low -> largest (the client asked for little reasoning: stop at the highest
calibrated risk); medium -> default; high -> smallest (the client wants accuracy: the tightest
risk bound, which still stops where the probe is confident); xhigh, max -> off (the most the
model can do: no early stop). `none` is not mapped: the chat template switches thinking off, and
the server defaults apply. An explicit delta (or `enabled`) in the request wins over the effort.
The operator changes entries with `--orca-effort-map low=0.2,high=off` (the rest keep their
defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

# the levels vLLM 0.32 accepts in chat's `reasoning_effort` (and the Messages API's effort)
EFFORT_LEVELS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class Target(StrEnum):
    """A table entry that names a delta by the bundle's table rather than by value: its largest
    delta (the earliest stops), its default, its smallest, or none (OFF: no early stop)."""

    LARGEST = "largest"
    DEFAULT = "default"
    SMALLEST = "smallest"
    OFF = "off"


SYMBOLS: tuple[str, ...] = tuple(str(t) for t in Target)  # what errors list
DEFAULT_EFFORT_MAP: dict[str, str | float] = {
    "minimal": Target.LARGEST, "low": Target.LARGEST, "medium": Target.DEFAULT,
    "high": Target.SMALLEST, "xhigh": Target.OFF, "max": Target.OFF}


def parse_effort_map(text: str) -> dict[str, str | float]:
    """`level=target,...` over the default table (ValueError: one line naming the bad entry)."""
    table = dict(DEFAULT_EFFORT_MAP)
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        level, sep, target = (s.strip() for s in item.partition("="))
        if not sep or level not in EFFORT_LEVELS:
            raise ValueError(f"{item!r}: expected LEVEL=TARGET with LEVEL one of "
                             f"{', '.join(EFFORT_LEVELS)}")
        if target in SYMBOLS:
            table[level] = Target(target)
            continue
        try:
            delta = float(target)
        except ValueError:
            raise ValueError(f"{item!r}: TARGET must be a delta in (0, 1) or one of "
                             f"{', '.join(SYMBOLS)}") from None
        if not 0 < delta < 1:
            raise ValueError(f"{item!r}: a delta must be in (0, 1)")
        table[level] = delta
    return table


def effort_delta(target: str | float, deltas: list[float], default_delta: float) -> float | None:
    """The delta one table entry stands for with a bundle's deltas; None: no early stop."""
    if target == Target.OFF:
        return None
    if target == Target.LARGEST:
        return max(deltas)
    if target == Target.SMALLEST:
        return min(deltas)
    if target == Target.DEFAULT:
        return default_delta
    return float(target)


def check_effort_map(table: Mapping[str, str | float], bundle: Any) -> None:
    """Every numeric delta of the table has a lambda* in `bundle` (raises its BundleError)."""
    for target in table.values():
        if not isinstance(target, str):
            bundle.lam(target)


def describe(table: Mapping[str, str | float]) -> str:
    """The table as the option spells it (for help and logs)."""
    return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in table.items())
