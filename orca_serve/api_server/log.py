"""orca-serve's log lines in the API server's log, formatted as vLLM's own
(`orca_serve.vllm_plugin.config.log_with_vllm`), and vLLM's API tracebacks by the response's status.

vLLM's Messages route logs every exception of its handler with `logger.exception`, so a client's
mistake (max_tokens above the context length) filled the log with a 40-line traceback per request.
Whether it was the client's is known only when vLLM answers: `ErrorsByStatus` holds such a record
back while the route's request runs (the middleware opens a `deferred_errors()` scope for it) and
logs it when the response starts: a 4xx as one WARNING line (the record's message, no traceback:
the server did nothing wrong), anything else as it was. No vLLM name is needed for it.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from orca_serve.vllm_plugin.config import VLLM_LOGGER, log_with_vllm

_API_LOGGERS = "vllm.entrypoints"
_DEFERRED: contextvars.ContextVar[list[logging.LogRecord] | None] = contextvars.ContextVar(
    "orca_deferred_errors", default=None)


class ErrorsByStatus(logging.Filter):
    """A handler filter: inside a `deferred_errors()` scope, a record with a traceback from
    vLLM's API loggers is held back (`release` logs it once the status is known)."""

    def filter(self, record: logging.LogRecord) -> bool:
        held = _DEFERRED.get()
        if held is None or not record.exc_info or getattr(record, "orca_released", False) \
                or not record.name.startswith(_API_LOGGERS):
            return True
        if not any(r is record for r in held):  # one record, each of vLLM's handlers
            held.append(record)
        return False


@contextmanager
def deferred_errors() -> Iterator[list[logging.LogRecord]]:
    """The scope of one request whose handler's error records wait for its status; records
    still held at its end (no response started) are logged as they were."""
    held: list[logging.LogRecord] = []
    token = _DEFERRED.set(held)
    try:
        yield held
    finally:
        _DEFERRED.reset(token)
        release(held, 500)


def release(held: list[logging.LogRecord], status: int) -> None:
    """Log the held records: for a client error (4xx) as one WARNING line without the
    traceback, else unchanged."""
    while held:
        record = held.pop(0)
        if 400 <= status < 500:
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.orca_released = True
        logging.getLogger(record.name).handle(record)


def log_like_vllm() -> None:
    """Give vLLM's handlers the `ErrorsByStatus` filter and the `orca_serve` logger vLLM's
    handlers and level (`log_with_vllm`: nothing when vLLM's logging configuration is off)."""
    for h in logging.getLogger(VLLM_LOGGER).handlers:
        if not any(isinstance(f, ErrorsByStatus) for f in h.filters):
            h.addFilter(ErrorsByStatus())
    log_with_vllm()
