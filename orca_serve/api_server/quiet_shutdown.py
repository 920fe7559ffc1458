"""One INFO line instead of an ERROR traceback when the server shuts down normally.

vLLM 0.32's `AsyncLLM.shutdown` stops the engine before it cancels the task that reads the
engine's outputs, so that task meets the dead engine and logs "AsyncLLM output_handler failed."
with an `EngineDeadError` traceback at ERROR level on a normal stop: an operator cannot tell it
from a crash. It happens most when the signal reaches the whole process group (Ctrl-C in a
terminal, systemd's default `KillMode`), so that the engine dies of its own copy of the signal
while the API server begins its shutdown. The filter below demotes exactly that record, and
only once a shutdown is under way: the API server's launcher has logged its shutdown trigger
(SIGTERM/SIGINT), or the engine client's finalizer has been taken (`MPClient.shutdown` in
vllm/v1/engine/core_client.py). An engine that dies on its own still logs its traceback at
ERROR.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

ASYNC_LLM_LOGGER = "vllm.v1.engine.async_llm"
LAUNCHER_LOGGER = "vllm.entrypoints.launchers.launcher"
SHUTDOWN_TRIGGERED = "[shutdown] API server: shutdown triggered"  # vLLM's signal handler logs it


def shutting_down(engine_client: Any) -> bool:
    """Whether vLLM has started shutting this engine client down (not a crash)."""
    finalizer = getattr(getattr(engine_client, "engine_core", None), "_finalizer", None)
    return finalizer is not None and not finalizer.alive


class ShutdownSeen(logging.Filter):
    """Notes the launcher's shutdown trigger (on vLLM's launcher logger; passes every record)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(SHUTDOWN_TRIGGERED):
            self.seen = True
        return True


class ShutdownNoise(logging.Filter):
    """Demotes the output handler's EngineDeadError record during a normal shutdown."""

    def __init__(self, engine_client: Callable[[], Any], trigger: ShutdownSeen) -> None:
        super().__init__()
        self.engine_client = engine_client
        self.trigger = trigger

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if (record.levelno >= logging.ERROR and type(exc).__name__ == "EngineDeadError"
                and (self.trigger.seen or shutting_down(self.engine_client()))):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.msg, record.args = "the engine was shut down; its output handler stopped", ()
            record.exc_info = record.exc_text = None
        return True


def install(engine_client: Callable[[], Any]) -> None:
    """Add the filter to vLLM's AsyncLLM logger (`engine_client`: returns the client, or None
    before it exists)."""
    trigger = ShutdownSeen()
    logging.getLogger(LAUNCHER_LOGGER).addFilter(trigger)
    logging.getLogger(ASYNC_LLM_LOGGER).addFilter(ShutdownNoise(engine_client, trigger))
