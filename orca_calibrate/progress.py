"""Progress bars that read well both in a terminal and in a job's log.

tqdm redraws its one line with carriage returns: right in a terminal, but where stderr is a file
or a pipe (a Kubernetes pod's log, `nohup ... > job.log`) every redraw lands in the log, dozens a
minute, as one line that only a terminal folds back. There the bar writes whole lines instead, at
most one every `LOG_INTERVAL_S` seconds, and the last one when it closes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm

LOG_INTERVAL_S = 60.0  # a log line per bar at most this often (a terminal redraws as tqdm does)


class _Lines:
    """The stream tqdm writes to in a log: each redraw (`"\\r" + the bar + padding`) one whole
    line; tqdm's own line ends and cursor returns dropped."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self._stream.write(line + "\n")

    def flush(self) -> None:
        self._stream.flush()


def progress_bar(iterable: Iterable[Any] | None = None, *, stream: TextIO | None = None,
                 **options: Any) -> tqdm:
    """A tqdm bar on `stream` (stderr by default): tqdm's own in a terminal, whole lines at most
    every `LOG_INTERVAL_S` in a log. Called as tqdm is (`iterable` first, then tqdm's `total`,
    `desc`, `disable`, ...), so it also stands in for tqdm where vLLM takes a bar's factory
    (`LLM.chat(..., use_tqdm=progress_bar)`)."""
    stream = sys.stderr if stream is None else stream
    if stream.isatty():
        return tqdm(iterable, file=stream, **options)
    return tqdm(iterable, file=_Lines(stream), mininterval=LOG_INTERVAL_S, ascii=True, **options)
