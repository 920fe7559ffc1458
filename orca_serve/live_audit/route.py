"""GET /v1/orca/audit: the live audit's table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orca_serve.live_audit.live import LiveAudit
from orca_serve.settings.field import error_body

AUDIT_PATH = "/v1/orca/audit"


def add_audit_route(app: Any, get_audit: Callable[[], LiveAudit | None]) -> None:
    """GET /v1/orca/audit: the table (404 on a server without a bundle)."""
    # deferred: fastapi (offline tools import this module)
    from fastapi.responses import JSONResponse

    # No return annotation: under `from __future__ import annotations` FastAPI cannot resolve
    # the string "JSONResponse" when it builds /openapi.json (HTTP 500).
    async def orca_audit():
        audit = get_audit()
        if audit is None:
            return JSONResponse(error_body(
                "this server runs without a calibration bundle (start orca-serve with --calib)",
                code=404, err_type="NotFoundError"), status_code=404)
        return JSONResponse(audit.table())

    app.add_api_route(AUDIT_PATH, orca_audit, methods=["GET"], name="orca_audit",
                      response_model=None)
