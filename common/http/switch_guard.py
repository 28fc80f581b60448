"""The HTTP side of a role switch (common/engine/role_switch.py): `POST /pd_role_switch` and the guard that, while
a switch is under way, answers new generations and the health paths 503 with X-Tandem-Draining (routers take the
server out of rotation without ending its requests and retry a refused one elsewhere), and counts the generations
in flight, which the switch waits for.

    POST /pd_role_switch {"new_role": "decode"}
      200 {"success": true, "message", "old_role", "new_role", "instance_id", "bootstrap"}
      400 a bad new_role, or --enable-pd-role-switch not given; 409 a switch already under way;
      503 what was in flight did not finish within --pd-role-switch-timeout-s (the role stays)
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from common.edge.asgi import read_body
from common.engine.engine import Engine
from common.engine.role_switch import RoleSwitch, SwitchRefused
from common.wire.body import parse_json_object
from common.wire.drain import DRAINING_HEADER
from common.wire.errors import InvalidRequest, Unavailable, error_body

GENERATIONS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
REFUSED = GENERATIONS | {"/health", "/health_generate"}
ERROR_TYPES = {400: "invalid_request_error", 409: "conflict_error", 503: "unavailable_error"}


class SwitchGuard:
    """ASGI middleware: while `switch` is under way, refuses new generations and the health paths."""

    def __init__(self, app: ASGIApp, switch: RoleSwitch) -> None:
        self.app, self.switch = app, switch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path") if scope["type"] == "http" else None
        if path in REFUSED and self.switch.refusing:
            error = Unavailable(
                f"this server is switching its role to {self.switch.target} and takes no new requests; "
                "retry on another server"
            )
            headers = {**error.headers, DRAINING_HEADER: "1"}
            await JSONResponse(error.to_dict(), 503, headers=headers)(scope, receive, send)
            return
        if path not in GENERATIONS:
            await self.app(scope, receive, send)
            return
        self.switch.generating += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.switch.generating -= 1


def add_role_switch_route(app: FastAPI, engine: Engine) -> None:
    @app.post("/pd_role_switch")
    async def pd_role_switch(request: Request) -> JSONResponse:
        if engine.role_switch is None:
            raise InvalidRequest(
                "this server was started without --enable-pd-role-switch: it cannot switch roles", param="new_role"
            )
        body: dict[str, Any] = parse_json_object(await read_body(request, engine.config.max_request_bytes))
        new_role = body.get("new_role")
        if not isinstance(new_role, str):
            raise InvalidRequest("new_role: give prefill or decode", param="new_role")
        try:
            return JSONResponse(await engine.role_switch.switch(new_role.lower()))
        except SwitchRefused as e:
            answer = error_body(str(e), ERROR_TYPES.get(e.status, "internal_error"), e.status, "new_role")
            answer |= {"success": False, "old_role": engine.mode, "new_role": new_role}
            return JSONResponse(answer, e.status)
