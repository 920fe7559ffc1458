"""vLLM's OpenAI-compatible FastAPI app plus orca-serve's additions, assembled once.

Nothing of vLLM's request handling is re-implemented. `orca_serve.api_server.assembly.build_server` makes
this process's `OrcaServer` (bundle, defaults, live audit, metrics, reloader); `install` adds to
the app vLLM's `build_app` is building, called by orca-serve's endpoint plugin
(orca_serve/api_server/endpoint_plugin.py; docs/PLUGIN.md says why not through `--middleware`):

- `OrcaMiddleware` (`orca_serve.api_server.middleware`; pure ASGI, innermost, so vLLM's auth/CORS run
  first): the `orca` request field in, the response's `orca` report out (`orca_serve.api_server.report`).
- GET /v1/orca/bundle: `Bundle.summary()` (404 without a bundle); POST /v1/orca/bundle and SIGHUP
  swap in a new bundle without a restart (`orca_serve.api_server.reload`). Every orca-enabled response names
  the bundle that served it (`bundle_checksum`).
- The `orca` request field in the published OpenAPI description (/openapi.json).
- Metrics (`orca_serve.metrics.prometheus`) on vLLM's `/metrics`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from fastapi.responses import JSONResponse
from starlette.middleware import Middleware

from orca_serve.api_server import quiet_shutdown
from orca_serve.api_server.admin import AdminMiddleware
from orca_serve.api_server.apis import INVOCATIONS_PATH, ORCA_PATHS
from orca_serve.api_server.assembly import OrcaServer, build_server
from orca_serve.live_audit.route import add_audit_route
from orca_serve.api_server.middleware import OrcaMiddleware
from orca_serve.settings.field import OrcaFields, error_body
from orca_serve.api_server.reload import BUNDLE_PATH
from orca_serve.vllm_compat import launch


# -- routes and app -----------------------------------------------------------------------------
def add_orca_routes(app: Any, server: OrcaServer) -> None:

    # No return annotation: under `from __future__ import annotations` FastAPI would have to
    # resolve the string "JSONResponse" when it builds /openapi.json, and fail (HTTP 500).
    async def orca_bundle():
        now = server.serving.now
        if now.bundle is None:
            return JSONResponse(error_body(
                "this server runs without a calibration bundle (start orca-serve with --calib)",
                code=404, err_type="NotFoundError"), status_code=404)
        out = {"path": now.bundle_path, **now.bundle.summary()}
        if server.reloader is not None and server.reloader.last is not None:
            out["last_reload"] = server.reloader.last
        return JSONResponse(out)

    app.add_api_route(BUNDLE_PATH, orca_bundle, methods=["GET"], name="orca_bundle",
                      response_model=None)


ORCA_SCHEMA = "OrcaFields"


def add_orca_to_openapi(schema: dict[str, Any]) -> dict[str, Any]:
    """vLLM's OpenAPI description plus the `orca` request field on the routes that take it.

    vLLM's request models do not know the field (the middleware removes it before they see it),
    so without this the published schema hides it from clients and schema-driven tools.
    """
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    orca = OrcaFields.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(orca.pop("$defs", {}))  # nested models (`give_up`) where refs point
    components[ORCA_SCHEMA] = orca
    field = {"anyOf": [{"$ref": f"#/components/schemas/{ORCA_SCHEMA}"}, {"type": "null"}],
             "description": "orca-serve: calibrated early stopping of the reasoning "
                            "(docs/SERVER.md); every field optional"}
    for path in sorted(set(ORCA_PATHS) - {INVOCATIONS_PATH}):
        op = (schema.get("paths", {}).get(path) or {}).get("post") or {}
        ref = (op.get("requestBody", {}).get("content", {}).get("application/json", {})
               .get("schema", {}).get("$ref", ""))
        model = components.get(ref.rsplit("/", 1)[-1]) if ref else None
        if model is not None:
            model.setdefault("properties", {})["orca"] = field
    return schema


def _install_openapi(app: Any) -> None:
    vllm_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = add_orca_to_openapi(vllm_openapi())
        return app.openapi_schema

    app.openapi = openapi


def install(app: Any, server: OrcaServer) -> Any:
    """Add the orca routes and middleware to a FastAPI app vLLM is building (the endpoint
    plugin's `attach_router`, before vLLM adds its CORS and API-key middleware)."""
    server.engine.bind(app.state)  # the live audit labels through it too (its engine client)
    add_orca_routes(app, server)
    _install_openapi(app)
    add_audit_route(app, lambda: server.serving.now.audit)
    # Appended: innermost whatever vLLM adds after us (vLLM's auth and CORS run first).
    app.user_middleware.append(Middleware(OrcaMiddleware, server=server))
    _rebuild(app)
    return app


def install_admin(app: Any, server: OrcaServer) -> None:
    """The admin route's middleware outermost (after vLLM added its own): its own credential is
    checked before vLLM's --api-key."""
    app.user_middleware.insert(0, Middleware(AdminMiddleware, reloader=server.reloader))
    _rebuild(app)


def _rebuild(app: Any) -> None:
    if app.middleware_stack is not None:  # vLLM's SageMaker bootstrap already built it
        app.middleware_stack = app.build_middleware_stack()


# the parsed option in which `run` hands its server to this process's endpoint plugin: vLLM gives
# every endpoint plugin the parsed command line it was started with (`app.state.args`)
SERVER_ARG = "orca_server"


def prepared(args: Any) -> OrcaServer:
    """This process's server: the one `run` handed over in `args` (the single API server, with
    its live audit and reload checks), else one built from vLLM's parsed command line (each
    process of --api-server-count N)."""
    handed = getattr(args, SERVER_ARG, None)
    if isinstance(handed, OrcaServer):
        return handed
    server = build_server(args)
    quiet_shutdown.install(server.engine.client)
    return server


def run(args: Any, server: OrcaServer) -> None:
    """Serve with vLLM's own launchers (orca_serve.vllm_compat.launch); our parts reach vLLM's
    app through the endpoint plugin (orca_serve.api_server.endpoint_plugin).

    One API server: vLLM's `run_server` in this process, serving `server`. Several
    (--api-server-count N): vLLM's `run_multi_api_server` (engines started here, N spawned API
    server processes sharing the port), each process building its own server. Each has its own
    engine client; a request's result is fetched by key with collective_rpc from any of them, so
    whichever process answers a request gets it.
    """
    if (getattr(args, "api_server_count", None) or 1) > 1:
        launch.run_multi(args)
        return
    quiet_shutdown.install(server.engine.client)
    reloader = server.reloader

    def on_loop() -> None:
        if reloader is not None:  # SIGHUP re-reads --calib (orca_serve.api_server.reload)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloader.on_sighup)

    try:
        launch.run_single(argparse.Namespace(**vars(args), **{SERVER_ARG: server}), on_loop)
    finally:  # stopped (SIGTERM, SIGINT) or failed: a fleet's replica leaves its store at once
        server.close()
