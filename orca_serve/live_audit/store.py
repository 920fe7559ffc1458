"""Where labelled audits go: trajectory directories (docs/TRAJECTORIES.md) under `--orca-audit-dir`.

    DIR/audit-000001/{info.json, problems.jsonl, embeddings.bin}
    DIR/audit-000002/...

Each audit is appended and flushed at once (orca_method/trajectories.py's writer: embeddings first,
the metadata line last), so every tool that reads trajectories reads an audit directory, and a
killed server loses at most the audit in flight. A directory holds at most `per_dir` audits; then
the next one is started, and only the newest `keep` directories are kept (the disk use is bounded
by about per_dir * keep audits). A restarted server resumes the newest directory when its settings
match (same model and procedure), and starts a new one otherwise.

Several servers may share one `--orca-audit-dir` (they share the guards' journal,
orca_serve/live_audit/journal.py): each directory has one writer at a time, which holds an
`flock` on its `.writer.lock`; a server that finds the newest directory held by another starts
its own, and rotation never deletes a directory a live writer holds.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np

from orca_method.trajectories import RECORDED_DTYPE, TrajectoryError, TrajectoryWriter

PREFIX = "audit-"
_NAME = re.compile(r"^audit-(\d{6})$")


class AuditStore:
    """Appends labelled audits to rotating trajectory directories (see the module docstring)."""

    def __init__(self, root: str | Path, *, dim: int, info: dict[str, Any], per_dir: int = 1000,
                 keep: int = 10, dtype: str = RECORDED_DTYPE) -> None:
        if per_dir < 1 or keep < 1:
            raise ValueError(f"per_dir and keep must be >= 1, got {per_dir}, {keep}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.dim, self.info, self.per_dir, self.keep, self.dtype = dim, info, per_dir, keep, dtype
        self.written = 0
        self._lock = threading.Lock()  # appends run in threads; two audits may share a store
        self._writer: TrajectoryWriter | None = None
        self._lock_fd = -1  # the flock of the directory being written
        self._count = 0
        existing = self.directories()
        if existing and self._claim(existing[-1]):
            try:
                self._open(existing[-1])
            except TrajectoryError:  # another model or procedure wrote it: leave it alone
                self._release()
                self._writer = None
        if self._writer is None or self._count >= per_dir:
            self._rotate()

    def _claim(self, path: Path) -> bool:
        """Take the directory's writer lock (False: another live process writes it)."""
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / ".writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._release()
        self._lock_fd = fd
        return True

    def _release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    @staticmethod
    def _held(path: Path) -> bool:
        """Whether a live writer holds the directory."""
        try:
            fd = os.open(path / ".writer.lock", os.O_RDWR)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def directories(self) -> list[Path]:
        """The audit directories, oldest first."""
        return sorted(p for p in self.root.iterdir() if p.is_dir() and _NAME.match(p.name))

    @property
    def current(self) -> Path:
        assert self._writer is not None
        return self._writer.path

    def _open(self, path: Path) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = TrajectoryWriter(path, self.dim, self.dtype, **self.info)
        self._count = len(self._writer.ids)

    def _rotate(self) -> None:
        while True:  # a new number; another server may take the same one at the same moment
            # past every entry of an audit directory's name, not only directories: a file or a
            # dangling link named so fails the mkdir, and the same number came back for ever
            last = max((int(m.group(1)) for p in self.root.iterdir()
                        if (m := _NAME.match(p.name))), default=0)
            path = self.root / f"{PREFIX}{last + 1:06d}"
            try:
                path.mkdir()
            except FileExistsError:
                continue
            if self._claim(path):
                break
        self._open(path)
        for old in self.directories()[:-self.keep]:
            if not self._held(old):
                shutil.rmtree(old, ignore_errors=True)

    def append(self, record: dict[str, Any], embeddings: np.ndarray) -> Path:
        """Write one labelled audit; returns the directory it went to."""
        with self._lock:
            if self._count >= self.per_dir:
                self._rotate()
            assert self._writer is not None
            self._writer.append(record, embeddings)
            self._count += 1
            self.written += 1
            return self._writer.path

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._release()
