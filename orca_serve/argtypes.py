"""argparse `type=` converters for orca-serve's options: one place for their one-line errors."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from orca_method.errors import shown
from orca_serve.effort import parse_effort_map


def integer(minimum: int) -> Callable[[str], int]:
    """An integer >= `minimum`."""

    def convert(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {shown(s)}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        return v

    return convert


def fraction(*, open_interval: bool) -> Callable[[str], float]:
    """A number in (0, 1) (`open_interval`) or in [0, 1]."""

    def convert(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {shown(s)}") from None
        inside = 0 < v < 1 if open_interval else 0 <= v <= 1
        if not inside:
            where = "(0, 1)" if open_interval else "[0, 1]"
            raise argparse.ArgumentTypeError(f"must be in {where}, got {v}")
        return v

    return convert


def effort_map(s: str) -> dict[str, str | float]:
    """`--orca-effort-map`: LEVEL=TARGET,... over the default table (`orca_serve.effort`)."""
    try:
        return parse_effort_map(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
