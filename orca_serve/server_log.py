"""orca-serve's log lines in the server's log, formatted as vLLM's own.

vLLM configures logging for its `vllm` logger only (a handler on it, `propagate` off); the root
logger keeps Python's defaults, so a line logged under `orca_serve.*` below WARNING is dropped and
one at WARNING or above reaches stderr only through Python's last-resort handler, unformatted and
only while no other handler exists anywhere up the hierarchy. Reload outcomes, alarms, fallback
and recalibration are INFO or WARNING lines operators must see, so the `orca_serve` logger gets
vLLM's handlers and level.

vLLM's Messages route logs every exception of its handler with `logger.exception`, so a client's
mistake (max_tokens above the context length) fills the log with a 40-line traceback per request.
A client error (one vLLM answers with a 4xx: its `VLLMClientError`s, and the ValueError, TypeError
and OverflowError its exception handlers map to 400) logged under `vllm.entrypoints` keeps its
one-line message, at WARNING (the server did nothing wrong), and loses the traceback
(`OneLineClientErrors`); server errors keep theirs.
"""

from __future__ import annotations

import logging
from typing import Any

ORCA_LOGGER = "orca_serve"
_API_LOGGERS = "vllm.entrypoints"
_CLIENT_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OverflowError)


def _client_errors() -> tuple[type[BaseException], ...]:
    try:
        from vllm.exceptions import VLLMClientError  # deferred: vllm (only in the server)
    except ImportError:  # a release without it (0.31): the built-in ones
        return _CLIENT_ERRORS
    return (*_CLIENT_ERRORS, VLLMClientError)


class OneLineClientErrors(logging.Filter):
    """A handler filter: a client error logged by vLLM's API handlers is one WARNING line (the
    record's message, without the traceback); see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.client_errors = _client_errors()

    def filter(self, record: logging.LogRecord) -> bool:
        exc: Any = record.exc_info[1] if record.exc_info else None
        if exc is not None and record.name.startswith(_API_LOGGERS) and \
                isinstance(exc, self.client_errors):
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def log_like_vllm() -> None:
    """Give the `orca_serve` logger vLLM's handlers and level (after vLLM configured logging),
    and vLLM's handlers the `OneLineClientErrors` filter.

    With vLLM's logging configuration turned off (VLLM_CONFIGURE_LOGGING=0) its logger has no
    handler and this does nothing: whoever configured logging decides.
    """
    vllm = logging.getLogger("vllm")
    if not vllm.handlers:
        return
    for h in vllm.handlers:
        if not any(isinstance(f, OneLineClientErrors) for f in h.filters):
            h.addFilter(OneLineClientErrors())
    orca = logging.getLogger(ORCA_LOGGER)
    for h in vllm.handlers:
        if h not in orca.handlers:
            orca.addHandler(h)
    orca.setLevel(vllm.level)
    orca.propagate = False
