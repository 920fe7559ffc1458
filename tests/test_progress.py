"""Progress bars in a terminal and in a log (orca_calibrate/progress.py)."""

from __future__ import annotations

import io

from orca_calibrate import progress
from orca_calibrate.progress import progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_whole_lines_not_every_redraw() -> None:
    """1,000 quick updates with a postfix, as the collector makes them: in a log, the opening
    line and the closing one(s), each whole; not a carriage return in it."""
    log = io.StringIO()
    with progress_bar(total=1000, desc="collect", unit="traj", stream=log) as bar:
        for i in range(1000):
            bar.update(1)
            bar.set_postfix(done=i, refresh=False)
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert 2 <= len(lines) <= 3, lines
    assert lines[0].startswith("collect:") and "0/1000" in lines[0]
    assert "1000/1000" in lines[-1] and "done=999" in lines[-1]


def test_a_log_line_each_interval(monkeypatch) -> None:
    """Where the interval has passed at each update, each update is a line."""
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    log = io.StringIO()
    with progress_bar(total=5, desc="label", stream=log) as bar:
        for _ in range(5):
            bar.update(1)
    counts = [line.split("|")[2].split()[0] for line in log.getvalue().splitlines()]
    assert counts[:6] == [f"{k}/5" for k in range(6)]


def test_a_terminal_gets_tqdms_own_bar() -> None:
    term = Terminal()
    with progress_bar(total=3, desc="train", stream=term) as bar:
        bar.update(3)
    assert "\r" in term.getvalue()  # redrawn in place


def test_disabled_writes_nothing() -> None:
    log = io.StringIO()
    with progress_bar(total=3, disable=True, stream=log) as bar:
        bar.update(3)
    assert log.getvalue() == ""


def test_it_stands_in_for_tqdm_where_vllm_takes_a_factory() -> None:
    """vLLM calls its bar factory as tqdm, the iterable first (`maybe_tqdm`)."""
    log = io.StringIO()
    assert list(progress_bar(range(3), desc="Adding requests", stream=log)) == [0, 1, 2]
    assert "3/3" in log.getvalue().splitlines()[-1]
