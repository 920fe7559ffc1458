"""The worker side of orca metrics on a stock vLLM server (orca_serve/metrics/stock.py): snapshot
files of the plugin's stats, written where the API server reads them.

Imports nothing of vLLM's at module level: `start_publisher` is a `vllm.general_plugins` entry
point, loaded in every vLLM process early in its start.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from orca_serve.vllm_compat.runner import is_reporting_worker

PUBLISH_S = 2.0  # how old the published stats may be
ENV_SERVER = "ORCA_SERVE_SERVER"  # "1": orca-serve's own server, which exports the orca metrics
DIR_PREFIX = "orca-metrics-"

_publisher: threading.Thread | None = None


def metrics_dir(pid: int) -> Path:
    """The directory where the workers of the API server process `pid` write their stats."""
    return Path(tempfile.gettempdir()) / f"{DIR_PREFIX}{pid}"


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state


def _ancestor_dir() -> Path | None:
    pid = _parent(os.getpid())
    while pid and pid > 1:
        d = metrics_dir(pid)
        if d.is_dir():
            return d
        pid = _parent(pid)
    return None


def read_snapshots(directory: Path) -> list[dict]:
    """The last stats each publishing worker wrote into `directory`."""
    out = []
    for f in directory.glob("*.json"):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue  # its process gone meanwhile
    return out


def _publish_forever() -> None:
    out: Path | None = None
    while True:
        time.sleep(PUBLISH_S)
        adapter = sys.modules.get("orca_serve.vllm_plugin.adapter")
        procs = list(getattr(adapter, "PROCESSORS", None) or [])
        if not procs:
            continue
        if not is_reporting_worker():
            return
        out = out if out is not None and out.is_dir() else _ancestor_dir()
        if out is None:
            continue
        # deferred: vllm (worker patches vLLM on import)
        from orca_serve.vllm_plugin.worker import processor_stats

        tmp = out / f".{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps(processor_stats(procs)))
            os.replace(tmp, out / f"{os.getpid()}.json")  # a reader never sees half a file
        except OSError:
            out = None  # the API server went away; look again


def start_publisher() -> None:
    """vLLM general plugin: start this process's publisher thread (once; it idles until an orca
    processor exists here and an ancestor process has a metrics directory). None in the
    processes of orca-serve (ENV_SERVER, which they inherit from its server): that server asks
    its engine for the stats itself, and a publisher there would only poll its ancestors every
    PUBLISH_S and write into the first directory it found (a stock vLLM process above it, or
    one that merely has the same name)."""
    global _publisher
    if os.environ.get(ENV_SERVER) == "1":
        return
    if _publisher is None:
        _publisher = threading.Thread(target=_publish_forever, name="orca-metrics", daemon=True)
        _publisher.start()
