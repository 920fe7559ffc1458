"""A stand-in for the job's vLLM collector (`orca_calibrate.job.Collector`), so the job's own
bookkeeping can be tested fast (tests/test_toy_job.py runs the real one). A test subclasses it
and writes its synthetic trajectory set in `run`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class FakeCollector:
    """The collector's interface: built with the model and settings, a context manager, `run`
    per trajectory directory."""

    def __init__(self, model: str, settings: Any) -> None:
        self.settings = settings

    def __enter__(self) -> FakeCollector:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def close(self) -> None:
        pass

    def run(self, prompts: list, out: Path, progress: bool, defer: Any = None) -> Any:
        raise NotImplementedError
