"""How orca-serve refuses to start: one line on stderr, exit code 2 (docs/SERVER.md)."""

from __future__ import annotations

import sys
from typing import NoReturn

PROG = "orca-serve"


class StartupError(Exception):
    """Refuse to start: printed as one line on stderr, exit code 2."""


def fail(msg: str, code: int = 2) -> NoReturn:
    print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(code)
