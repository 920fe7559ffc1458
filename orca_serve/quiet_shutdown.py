"""One INFO line instead of an ERROR traceback when the server shuts down normally.

vLLM 0.32's `AsyncLLM.shutdown` stops the engine before it cancels the task that reads the
engine's outputs, so that task meets the dead engine and logs "AsyncLLM output_handler failed."
with an `EngineDeadError` traceback at ERROR level on every normal stop (SIGTERM, Ctrl-C): an
operator cannot tell it from a crash. The filter below demotes exactly that record, and only
while a shutdown that vLLM started is under way (its engine client's finalizer has been taken,
`MPClient.shutdown` in vllm/v1/engine/core_client.py); an engine that dies on its own still
logs its traceback at ERROR.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

ASYNC_LLM_LOGGER = "vllm.v1.engine.async_llm"


def shutting_down(engine_client: Any) -> bool:
    """Whether vLLM has started shutting this engine client down (not a crash)."""
    finalizer = getattr(getattr(engine_client, "engine_core", None), "_finalizer", None)
    return finalizer is not None and not finalizer.alive


class ShutdownNoise(logging.Filter):
    """Demotes the output handler's EngineDeadError record during a normal shutdown."""

    def __init__(self, engine_client: Callable[[], Any]) -> None:
        super().__init__()
        self.engine_client = engine_client

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if (record.levelno >= logging.ERROR and type(exc).__name__ == "EngineDeadError"
                and shutting_down(self.engine_client())):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.msg, record.args = "the engine was shut down; its output handler stopped", ()
            record.exc_info = record.exc_text = None
        return True


def install(engine_client: Callable[[], Any]) -> None:
    """Add the filter to vLLM's AsyncLLM logger (`engine_client`: returns the client, or None
    before it exists)."""
    logging.getLogger(ASYNC_LLM_LOGGER).addFilter(ShutdownNoise(engine_client))
