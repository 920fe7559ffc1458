"""orca-serve's parts in vLLM's app through vLLM's endpoint-plugin interface
(`vllm.endpoint_plugins`, vLLM 0.31-0.33: `attach_router(app)`, `init_state(...)`), loaded by
vLLM in every API server process it starts (one, or N under --api-server-count N).

`attach_router` runs inside vLLM's `build_app` after vLLM's routes and before vLLM adds its CORS
and API-key middleware, so the orca middleware appended there sits inside them (vLLM's auth and
CORS run first). `init_state` runs once the app is built: the admin route's middleware goes
outermost then, since its own key must be checked before vLLM's `--api-key`.

vLLM loads an endpoint plugin only when `VLLM_PLUGINS` names it (routes are network surface),
and `VLLM_PLUGINS` also filters every other plugin group. `allow()` (called by orca-serve before
vLLM is imported) therefore names ours and, when the variable was unset, every plugin of the
other groups installed, so that those load as before; a user who set it keeps their list, with
`orca-serve` added. Other endpoint plugins stay off, as in plain vLLM.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from typing import Any

NAME = "orca-serve"  # our entry point in the `vllm.endpoint_plugins` group (pyproject.toml)
ENV = "VLLM_PLUGINS"
# the groups VLLM_PLUGINS filters besides the endpoint plugins (vllm/plugins/__init__.py)
OTHER_GROUPS = ("vllm.general_plugins", "vllm.platform_plugins", "vllm.io_processor_plugins",
                "vllm.stat_logger_plugins")


def allow() -> str | None:
    """Name our endpoint plugin in VLLM_PLUGINS (see the module docstring); returns a note to
    print when the user's own list was extended."""
    given = os.environ.get(ENV)
    if given is None:
        names = sorted({ep.name for g in OTHER_GROUPS for ep in entry_points(group=g)})
        os.environ[ENV] = ",".join([*names, NAME])
        return None
    names = [n for n in given.split(",") if n]
    if NAME in names:
        return None
    os.environ[ENV] = ",".join([*names, NAME])
    return f"{ENV} was set: {NAME} added to it (its endpoint plugin adds the orca routes)"


class OrcaEndpointPlugin:
    """The `vllm.endpoint_plugins` entry point (vLLM builds it without arguments)."""

    name = NAME
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self._app: Any = None
        self._server: Any = None

    def attach_router(self, app: Any) -> None:
        """Our routes, OpenAPI field and middleware on vLLM's app; this process's server is the
        one `orca_serve.api_server.server.run` handed over in vLLM's parsed command line (`app.state.args`),
        else built from it (each of N API server processes). An app not started by orca-serve is left alone."""
        from orca_serve.api_server import server  # deferred: torch (vLLM loads this in every API server)

        args = getattr(app.state, "args", None)
        if args is None or not hasattr(args, "calib"):
            return
        self._app, self._server = app, server.prepared(args)
        server.install(app, self._server)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """The admin route outermost, now that vLLM has added its own middleware."""
        if self._app is None:
            return
        from orca_serve.api_server.server import install_admin  # deferred: torch

        install_admin(self._app, self._server)
