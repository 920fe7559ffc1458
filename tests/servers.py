"""An `OrcaServer` for the tests that drive the middleware or the reloader without vLLM (a fake
engine client, or a fake `rpc`), assembled as `orca_serve.api_server.assembly.build_server` does."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from orca_serve.api_server.assembly import OrcaServer
from orca_serve.settings.contract import OrcaResult, Policy
from orca_serve.live_audit.live import LiveAudit
from orca_serve.metrics.prometheus import OrcaMetrics
from orca_serve.api_server.reload import Reloader
from orca_serve.settings.resolve import OrcaDefaults
from orca_serve.api_server.state import EngineLink, Serving, ServingRef


def orca_server(bundle: Any, defaults: OrcaDefaults, *, engine: Any = None,
                rpc: Callable[..., Any] | None = None, metrics: OrcaMetrics | None = None,
                audit: LiveAudit | None = None, bundle_path: str | None = None,
                reloader: dict[str, Any] | None = None) -> OrcaServer:
    """`engine`: a fake engine client (its `collective_rpc`); `rpc`: a fake of
    `EngineLink.rpc` instead; `reloader`: Reloader keyword arguments (None: no reloader)."""
    serving = ServingRef(Serving(bundle, bundle_path, defaults, audit))
    link = EngineLink()
    link.bind(SimpleNamespace(engine_client=engine))
    if rpc is not None:
        link.rpc = rpc  # type: ignore[method-assign]
    r = None if reloader is None else Reloader(serving, link, metrics=metrics, **reloader)
    return OrcaServer(serving, link, metrics, r)


def orca_result(**fields: Any) -> OrcaResult:
    """A plugin result of an enabled, policy-answer request that scored nothing, with `fields`
    changed (what the engine would report)."""
    base: dict[str, Any] = {
        "enabled": True, "policy": Policy.ANSWER, "delta": 0.1, "lam": 0.5, "steps_scored": 0,
        "stopped_early": False, "stop_step": None, "would_stop_step": None, "last_score": None,
        "scores": [], "reasoning_tokens": 0, "forced_tokens": [], "stop_reason": None,
        "index": 0}
    return OrcaResult(**{**base, **fields})
