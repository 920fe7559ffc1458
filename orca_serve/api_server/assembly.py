"""orca-serve's parts of one API server process, assembled once (`build_server`): the bundle,
the request defaults, the metrics, the live audit, the gate alarm and the reloader, around one
`Serving` that only a hot reload swaps (`orca_serve.api_server.state`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orca_method.bundle import Bundle, load_bundle
from orca_method.bundle_checks import check_semantics
from orca_method.outcomes import GiveUpPolicy
from orca_serve.settings.contract import DEFAULTS, Policy
from orca_serve.settings.effort import DEFAULT_EFFORT_MAP
from orca_serve.live_audit.collector import AuditCollector
from orca_serve.live_audit.factory import make_live_audit
from orca_serve.live_audit.options import AuditConfig
from orca_serve.metrics.prometheus import OrcaMetrics
from orca_serve.api_server.reload import Reloader
from orca_serve.settings.resolve import OrcaDefaults
from orca_serve.api_server.state import EngineLink, Serving, ServingRef


@dataclass(frozen=True)
class OrcaServer:
    """orca-serve's parts of one API server process, assembled once
    (`build_server`)."""

    serving: ServingRef
    engine: EngineLink
    metrics: OrcaMetrics | None = None  # None without a bundle
    reloader: Reloader | None = None  # hot reload (None without a bundle)

    def close(self) -> None:
        """The server stopped: the audit that serves leaves its journal (`LiveAudit.close`)."""
        if self.serving.now.audit is not None:
            self.serving.now.audit.close()

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
        give_up_policy=GiveUpPolicy(getattr(args, "orca_give_up_policy", None)
                                    or DEFAULTS.give_up_policy),
        shift_alpha=getattr(args, "orca_shift_alpha", None),
        shift_give_up_alpha=getattr(args, "orca_shift_give_up_alpha", None),
        vote_waves=getattr(args, "orca_vote_waves", None))


def served_model_name(args: Any) -> str:
    """The model name vLLM serves and puts in its metrics' `model_name` label."""
    names = getattr(args, "served_model_name", None)
    if isinstance(names, list):
        return str(names[0]) if names else str(args.model)
    return str(names or args.model)


def build_server(args: Any, bundle: Bundle | None = None, *,
                 check: Callable[[Bundle], str | None] = check_semantics,
                 audit_config: Callable[[Bundle], AuditConfig] | None = None) -> OrcaServer:
    """This process's orca parts from the parsed command line, assembled once: the bundle
    (`bundle`: the one the caller loaded and checked already; else `args.calib` is read), the
    defaults, the metrics, the live audit (configured by `audit_config`, per bundle, on a hot
    reload too; None: no audit; OSError or ValueError when its directory cannot be used) and the
    reloader, whose checks of a new bundle are `check` (the start-up checks against the served
    model)."""
    if bundle is None and args.calib:
        bundle = load_bundle(args.calib)
    path = str(Path(args.calib).absolute()) if args.calib else None
    if bundle is None:
        return OrcaServer(ServingRef(Serving(None, None, orca_defaults(args, None))), EngineLink())
    metrics = OrcaMetrics(model_name=served_model_name(args))
    engine = EngineLink()
    audit = (None if audit_config is None
             else make_live_audit(bundle, audit_config(bundle), engine.client))
    defaults = orca_defaults(args, bundle)
    serving = ServingRef(Serving(bundle, path, defaults, audit))
    if audit is not None:  # the metrics of whichever audit serves (a reload swaps it)
        metrics.registry.register(AuditCollector(lambda: serving.now.audit, metrics.model_name))
    key_env = getattr(args, "orca_admin_key_env", None)
    reloader = Reloader(
        serving, engine, calib_path=path or "", fixed_delta=getattr(args, "orca_delta", None),
        admin_key=os.environ.get(key_env) if key_env else None, metrics=metrics, check=check,
        audit_config=audit_config)
    metrics.bundle_in_use(bundle.checksum)
    return OrcaServer(serving, engine, metrics, reloader)
