"""`POST /v1/orca/bundle`: hot reload by an operator (`orca_serve.api_server.reload`), behind its own admin
key, and the small ASGI helpers the orca middlewares share."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from orca_serve.settings.field import error_body
from orca_serve.api_server.reload import BUNDLE_PATH, Reloader, ReloadRefused


async def send_json(send: Callable, status: int, payload: dict[str, Any],
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def route_path(scope: dict) -> str:
    """The request's path without the app's root path."""
    path = scope.get("path", "")
    root = scope.get("root_path", "") or ""
    return path[len(root):] if root and path.startswith(root) else path


class AdminMiddleware:
    """`POST /v1/orca/bundle`, outermost: the admin key is this route's one credential (vLLM's
    --api-key guards the other routes; it shares the Authorization header, so its check must not
    run first). Without --orca-admin-key-env the route does not exist (404)."""

    def __init__(self, app: Any, reloader: Reloader | None) -> None:
        self.app = app
        self.reloader = reloader

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or route_path(scope) != BUNDLE_PATH):
            return await self.app(scope, receive, send)
        r = self.reloader
        if r is None or not r.admin_key:
            return await send_json(send, 404, error_body(
                "hot reload is off: start orca-serve with --calib and --orca-admin-key-env VAR",
                code=404, err_type="NotFoundError"))
        token = None
        for k, v in scope.get("headers", []):
            if k.lower() == b"authorization":
                scheme, _, param = v.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    token = param.strip()
        if not token:
            return await send_json(send, 401, error_body(
                "this route needs the admin key: Authorization: Bearer <key>", code=401,
                err_type="AuthenticationError"), [(b"www-authenticate", b"Bearer")])
        if not hmac.compare_digest(token.encode(), r.admin_key.encode()):
            return await send_json(send, 403, error_body(
                "wrong admin key", code=403, err_type="PermissionDeniedError"))
        body = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if not msg.get("more_body", False):
                break
        try:
            req = json.loads(body) if body else None
        except (ValueError, RecursionError):
            req = None
        path = req.get("path") if isinstance(req, dict) else None
        if not isinstance(path, str) or not path or set(req) != {"path"}:
            return await send_json(send, 400, error_body(
                'the body must be {"path": "<bundle.json on the server>"}', "path"))
        try:
            out = await r.reload(path, source="POST")
        except ReloadRefused as e:
            return await send_json(send, 400, error_body(e.message, "path"))
        await send_json(send, 200, {**out, "bundle": r.serving.now.bundle.summary()})
