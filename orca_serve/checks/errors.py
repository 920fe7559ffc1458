"""How orca-serve refuses to start: one line on stderr, exit code 2 (docs/SERVER.md); and how a
SIGTERM stops a command of ours that has started vLLM's engines (`exit_on_sigterm`)."""

from __future__ import annotations

import signal
import sys
from typing import Any, NoReturn

PROG = "orca-serve"


class StartupError(Exception):
    """Refuse to start: printed as one line on stderr, exit code 2."""


def fail(msg: str, code: int = 2) -> NoReturn:
    print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(code)


class Stopped(SystemExit):
    """SIGTERM, raised in the main thread by `exit_on_sigterm`'s handler (exit code 143)."""


def exit_on_sigterm() -> None:
    """SIGTERM raises `Stopped` in the main thread, so that the clean-ups on the way out (vLLM's
    engine shutdown) run: killed outright, the process leaves vLLM's engine processes running,
    orphaned. A SystemExit, unlike the KeyboardInterrupt vLLM's own handlers raise, which a part
    of vLLM's engine start swallows. A second SIGTERM is ignored: it would cut the clean-up short.
    """
    def stop(signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Stopped(128 + signum)

    signal.signal(signal.SIGTERM, stop)
