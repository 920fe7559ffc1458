"""The server's state, built once (`orca_serve.api_server.server.build_server`): what requests are resolved
with (`Serving`, immutable, swapped whole by a hot reload) and the link to the engine.

No vLLM import: the engine client is vLLM's, reached through `rpc_all`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orca_serve.api_server.report import ResultFetcher
from orca_serve.settings.resolve import OrcaDefaults, Thresholds
from orca_serve.vllm_compat.engine_client import rpc_all

if TYPE_CHECKING:
    from orca_method.bundle import Bundle
    from orca_serve.live_audit.live import LiveAudit

logger = logging.getLogger("orca_serve.api_server.server")

STATS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Serving:
    """What a request is resolved with: the bundle, the defaults and the live audit that go
    together. A request reads one `Serving` from start to end, so a reload that
    swaps it in between never mixes two bundles in one request."""

    bundle: Bundle | None
    bundle_path: str | None
    defaults: OrcaDefaults
    audit: LiveAudit | None = None

    @property
    def thresholds(self) -> Thresholds | None:
        """Where lambda* and mu* come from: the live audit's guards, else the bundle (None)."""
        return self.audit

    @property
    def checksum(self) -> str | None:
        return None if self.bundle is None else self.bundle.checksum


class ServingRef:
    """The current `Serving`; `swap` is the one change (hot reload), synchronous on the loop."""

    def __init__(self, serving: Serving) -> None:
        self._serving = serving

    @property
    def now(self) -> Serving:
        return self._serving

    def swap(self, serving: Serving) -> Serving:
        """Make `serving` current; returns the one it replaced."""
        old, self._serving = self._serving, serving
        return old


class EngineLink:
    """`collective_rpc` on every engine this API server talks to (a request's result lives on
    the engine that ran it): one answer per worker. vLLM makes its engine client after the app,
    so the link reads it from the app's state at first use (`bind`)."""

    def __init__(self) -> None:
        self._get: Callable[[], Any] = lambda: None
        self._fetcher: ResultFetcher | None = None

    def bind(self, app_state: Any) -> None:
        self._get = lambda: getattr(app_state, "engine_client", None)

    def client(self) -> Any:
        return self._get()

    async def rpc(self, method: str, args: tuple = ()) -> Any:
        client = self.client()
        if client is None:
            raise RuntimeError("engine client not ready")
        return await rpc_all(client, method, args)

    @property
    def fetcher(self) -> ResultFetcher:
        if self._fetcher is None:  # made on the server's event loop, at the first request
            self._fetcher = ResultFetcher(self.rpc)
        return self._fetcher

    async def stats(self) -> list[Any] | None:
        """The engines' `orca_stats` (None when they cannot be read: logged)."""
        try:
            return await asyncio.wait_for(self.rpc("orca_stats"), STATS_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a scrape must not fail on it
            logger.warning("orca: reading orca_stats failed: %r", e)
            return None

