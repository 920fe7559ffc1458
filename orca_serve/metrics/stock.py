"""Orca metrics on vLLM's own OpenAI server (`vllm serve` / the api_server module, no orca-serve).

orca-serve's server asks the engine for the plugin's stats with collective_rpc at every scrape
(orca_serve/metrics/prometheus.py). A stock vLLM server makes no such call, and vLLM's stat-logger
interface hands a plugin only vLLM's own scheduler and iteration stats, which carry nothing of a
logits processor's. The plugin's counters live in the worker processes, so two entry points of
vLLM's carry them to the API server's /metrics:

- `OrcaStatLogger` (group `vllm.stat_logger_plugins`): vLLM's AsyncLLM creates it in the API
  server process. When the engine runs the orca processor (`additional_config["orca"]`) and the
  server is not orca-serve (which exports these metrics itself, and says so in ENV_SERVER), it
  makes a directory named for its process id and registers, on the registry vLLM's /metrics
  serves, a collector that reads the directory at every scrape.
- `orca_serve.metrics.snapshots.start_publisher` (group `vllm.general_plugins`, which vLLM runs
  in every one of its processes): a thread that, every PUBLISH_S seconds, writes the cumulative
  stats of the orca processors of its process into the directory of the nearest ancestor
  process that has one (the API server started the engine core, which started the workers),
  from the one worker that speaks for its engine (`vllm_compat.runner.is_reporting_worker`).

Exported, at most PUBLISH_S old, with the served model name as `model_name`: the engine-side
metrics of orca_serve/metrics/prometheus.py (orca_probe_seconds_total, orca_engine_steps_total,
orca_engine_tracked_requests, orca_engine_stored_results, orca_engine_bundles_loaded, and the
gate alarm's orca_shift_alarm and orca_shift_alarm_changes_total) and orca_steps_scored_total.
Not exported: the per-request ones (orca_requests_total{outcome}, stop
steps, scores, tokens saved), which orca-serve builds from the results it fetches per request: a
stock server fetches none. The workers must share the API server's machine (not Ray on others).
"""

from __future__ import annotations

import atexit
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily
from vllm.v1.metrics.loggers import StatLoggerBase  # the interface of vllm.stat_logger_plugins

from orca_serve.metrics.prometheus import LABEL, EngineStats
from orca_serve.metrics.snapshots import ENV_SERVER, metrics_dir, read_snapshots
from orca_serve.settings.engine_config import KEY

_registered = False  # one collector per API server process (vLLM makes a logger per engine)


class OrcaStatLogger(StatLoggerBase):
    """A vLLM stat logger that logs nothing itself: it puts the orca collector on vLLM's metrics
    registry (see the module docstring)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        global _registered
        orca = (getattr(vllm_config, "additional_config", None) or {}).get(KEY)
        if orca is None or os.environ.get(ENV_SERVER) == "1" or _registered:
            return
        d = metrics_dir(os.getpid())
        shutil.rmtree(d, ignore_errors=True)  # a dead process of the same pid may have left it
        d.mkdir(parents=True)
        atexit.register(shutil.rmtree, d, True)
        model = vllm_config.model_config
        names = getattr(model, "served_model_name", None)
        name = names[0] if isinstance(names, list | tuple) and names else names
        REGISTRY.register(PublishedStats(d, str(name or model.model)))
        _registered = True

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass


class PublishedStats(EngineStats):
    """orca_serve.metrics.prometheus.EngineStats read from the workers' snapshot files at each scrape,
    plus orca_steps_scored_total."""

    def __init__(self, directory: Path, model_name: str) -> None:
        super().__init__(model_name)
        self.directory = directory
        self.steps_scored = 0

    def collect(self) -> Iterable[Any]:
        per_worker = read_snapshots(self.directory)
        self.update_from(per_worker)
        self.steps_scored = max(self.steps_scored,  # a counter: never down
                                sum(int(w.get("steps_scored") or 0) for w in per_worker))
        yield from super().collect()
        c = CounterMetricFamily("orca_steps_scored", "Reasoning steps scored by the probe",
                                labels=[LABEL])
        c.add_metric([self.model_name], self.steps_scored)
        yield c
