"""Writing a file whole or not at all (readers: other workers of a cluster, a restarted server,
a resumed job) by writing a temporary file beside it and renaming it over the path."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes | str, *, fsync: bool = False) -> None:
    """Write `data` to `path` so that a reader sees the old file or the new one, never half of
    one; `fsync`: also survive a machine's crash (the data reaches the disk before the rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
