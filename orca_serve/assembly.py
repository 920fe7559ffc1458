"""orca-serve's parts of one API server process, assembled once (`build_server`): the bundle,
the request defaults, the metrics, the live audit and the reloader, around one `Serving` that
only a hot reload swaps (`orca_serve.serving_state`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orca_method.bundle import Bundle, load_bundle
from orca_method.bundle_checks import check_semantics
from orca_serve.contract import DEFAULTS, Policy
from orca_serve.effort import DEFAULT_EFFORT_MAP
from orca_serve.live_audit.live import LiveAudit
from orca_serve.metrics import OrcaMetrics
from orca_serve.reload import Reloader
from orca_serve.requests import OrcaDefaults
from orca_serve.serving_state import EngineLink, Serving, ServingRef


@dataclass(frozen=True)
class OrcaServer:
    """orca-serve's parts of one API server process, assembled once
    (`build_server`)."""

    serving: ServingRef
    engine: EngineLink
    metrics: OrcaMetrics | None = None  # None without a bundle
    reloader: Reloader | None = None  # hot reload (None without a bundle)

    async def refresh_engine_stats(self) -> None:
        """The engines' probe-time counters into the metrics (before a scrape)."""
        if self.metrics is None or self.serving.now.bundle is None:
            return
        stats = await self.engine.stats()
        if stats is not None:
            self.metrics.update_engine_stats(stats)


def orca_defaults(args: Any, bundle: Bundle | None) -> OrcaDefaults:
    """Server-wide request defaults from the parsed command line (--orca-* options)."""
    if bundle is None:
        return OrcaDefaults(enabled=False)
    table = getattr(args, "orca_effort_map", None)
    return OrcaDefaults(
        enabled=True,
        delta=args.orca_delta if args.orca_delta is not None else bundle.default_delta,
        policy=Policy(args.orca_policy), answer_budget=args.orca_answer_budget,
        effort_map=dict(DEFAULT_EFFORT_MAP if table is None else table),
        give_up_delta=getattr(args, "orca_give_up_delta", None),
        give_up_policy=getattr(args, "orca_give_up_policy", None) or DEFAULTS["give_up_policy"])


def served_model_name(args: Any) -> str:
    """The model name vLLM serves and puts in its metrics' `model_name` label."""
    names = getattr(args, "served_model_name", None)
    if isinstance(names, list):
        return str(names[0]) if names else str(args.model)
    return str(names or args.model)


# (bundle, metrics registry or None, model name, store?) -> the live audit
AuditFactory = Callable[[Bundle, Any, str, bool], LiveAudit]


def build_server(args: Any, bundle: Bundle | None = None, *,
                 check: Callable[[Bundle], str | None] = check_semantics,
                 make_audit: AuditFactory | None = None) -> OrcaServer:
    """This process's orca parts from the parsed command line, assembled once: the bundle
    (`bundle`: the one the caller loaded and checked already; else `args.calib` is read), the
    defaults, the metrics, the live audit (`make_audit`; None: no audit) and the reloader, whose
    checks of a new bundle are `check` (the start-up checks against the served model)."""
    if bundle is None and args.calib:
        bundle = load_bundle(args.calib)
    path = str(Path(args.calib).absolute()) if args.calib else None
    if bundle is None:
        return OrcaServer(ServingRef(Serving(None, None, orca_defaults(args, None))), EngineLink())
    metrics = OrcaMetrics(model_name=served_model_name(args))
    audit = None if make_audit is None else make_audit(bundle, metrics.registry,
                                                       metrics.model_name, True)
    serving = ServingRef(Serving(bundle, path, orca_defaults(args, bundle), audit))
    engine = EngineLink()
    key_env = getattr(args, "orca_admin_key_env", None)
    reloader = Reloader(
        serving, engine, calib_path=path or "", fixed_delta=getattr(args, "orca_delta", None),
        admin_key=os.environ.get(key_env) if key_env else None, metrics=metrics, check=check,
        make_audit=None if make_audit is None else functools.partial(
            _unregistered_audit, make_audit, metrics.model_name))
    metrics.bundle_in_use(bundle.checksum)
    return OrcaServer(serving, engine, metrics, reloader)


def _unregistered_audit(make: AuditFactory, model_name: str, bundle: Bundle) -> LiveAudit:
    """A reload's new audit: without store or metrics registration (it takes the old one's)."""
    return make(bundle, None, model_name, False)
