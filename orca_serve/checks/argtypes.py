"""argparse for orca-serve's and orca-calibrate's options: one place for their one-line errors
(the `type=` converters and the parser that raises instead of printing its usage).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from orca_method.consensus import parse_waves
from orca_method.errors import shown
from orca_serve.settings.effort import parse_effort_map


class OptionError(Exception):
    """A bad command-line option or value, as one line; the program prints it after `prog`
    (the command, with its subcommand) and exits 2."""

    def __init__(self, message: str, prog: str) -> None:
        super().__init__(message)
        self.prog = prog


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line: a bad option raises OptionError ("MESSAGE (PROG
    HINT)") instead of printing the usage (4-9 lines) and exiting. Subcommands' parsers are of
    the same class (argparse's default for add_subparsers), so theirs are one line too."""

    hint = "--help lists the options"

    def error(self, message: str) -> NoReturn:
        raise OptionError(f"{message} ({self.prog} {self.hint})", self.prog)


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


def level(s: str) -> float:
    """A probability level in [0, 1) (0: off)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {shown(s)}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (0: off), got {v}")
    return v


def waves(s: str) -> tuple[int, ...]:
    """`--orca-vote-waves`: wave sizes joined by '+' (`orca_method.consensus.parse_waves`)."""
    try:
        return parse_waves(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def effort_map(s: str) -> dict[str, str | float]:
    """`--orca-effort-map`: LEVEL=TARGET,... over the default table (`orca_serve.settings.effort`)."""
    try:
        return parse_effort_map(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def out_file(s: str) -> str:
    """A file to write: named, and not an existing folder (found before the work it ends, not
    after it, with a temporary file left behind)."""
    if not s:
        raise argparse.ArgumentTypeError("is empty: give a file path")
    if Path(s).is_dir():
        raise argparse.ArgumentTypeError(f"{shown(s)} is a folder: give a file path")
    return s


def out_dir(s: str) -> str:
    """A folder to write into: named (an empty path wrote into the working folder)."""
    if not s:
        raise argparse.ArgumentTypeError("is empty: give a folder path")
    return s
