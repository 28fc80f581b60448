"""What a PD server tells routers of its role: the role headers (on /health, and on every refusal below) and the
refusal of a request meant for the other role.

A router sends each half of a PD request with `X-Tandem-Role` naming the role it means it for (router/pair_call.py).
A server of the other role (a role switch changed it since the router last read its /health: POST /pd_role_switch
sent to the server itself, by an operator or a planner) answers at once, before it reads the body, so nothing is
reserved and no room waits for a peer:

    409 {"error": {"type": "conflict_error", "param": "X-Tandem-Role", "message": "this server is a prefill ..."}}
        with the role headers: X-Tandem-Role (its role), X-Tandem-Instance-Id, X-Tandem-Bootstrap (a prefill's)

The router follows those headers and moves the request to another pair (router/dispatch.py). A request without the
header (a client's own, an older router's) is served as before; a monolithic server has no role to check.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from common.engine.engine import Engine
from common.http.switch_guard import GENERATIONS
from common.wire.api import BOOTSTRAP_HEADER, INSTANCE_HEADER, RECOMPUTE_HEADER, ROLE_HEADER
from common.wire.errors import Conflict, InvalidRequest

PD_ROLES = ("prefill", "decode")
ROLE_KEY = ROLE_HEADER.lower().encode()  # as ASGI has request headers: lower-case bytes


def role_headers(engine: Engine) -> dict[str, str] | None:
    """A PD server's instance id, role and (a prefill's) bootstrap registry: what a router needs to follow it through
    restarts and role switches."""
    if engine.instance_id is None:
        return None
    headers = {INSTANCE_HEADER: engine.instance_id, ROLE_HEADER: engine.mode}
    bootstrap = engine.bootstrap_address()
    if bootstrap is not None:
        headers[BOOTSTRAP_HEADER] = bootstrap
    if engine.mode == "decode" and engine.config.kv_load_failure_policy == "recompute":
        headers[RECOMPUTE_HEADER] = (
            "1"  # it computes a prompt whose KV did not come: its requests outlive their prefill
        )
    return headers


def role_refusal(engine: Engine, meant: str) -> Conflict | InvalidRequest | None:
    """Why a generation meant for role `meant` (its X-Tandem-Role) is refused here, or None."""
    if meant not in PD_ROLES:
        return InvalidRequest(f"{ROLE_HEADER}: give prefill or decode, not {meant!r}", param=ROLE_HEADER)
    if meant == engine.mode:
        return None
    what = f"a {engine.mode} server" if engine.mode in PD_ROLES else "without a role (a role switch failed)"
    return Conflict(
        f"this server is {what}, not a {meant} one (its role was switched): re-read its role (GET /health) and "
        "send the request to another pair",
        param=ROLE_HEADER,
    )


class RoleGuard:
    """ASGI middleware of a PD server: refuses a generation whose X-Tandem-Role names the other role (module docstring).
    Inside the switch guard, which refuses everything while a switch is under way (the role is in flux then)."""

    def __init__(self, app: ASGIApp, engine: Engine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        meant = _meant_role(scope) if scope["type"] == "http" and scope["path"] in GENERATIONS else None
        error = role_refusal(self.engine, meant) if meant is not None else None
        if error is None:
            await self.app(scope, receive, send)
            return
        headers = role_headers(self.engine) if error.status == 409 else None
        await JSONResponse(error.to_dict(), error.status, headers=headers)(scope, receive, send)


def _meant_role(scope: Scope) -> str | None:
    for key, value in scope["headers"]:
        if key == ROLE_KEY:
            return value.decode("latin-1").strip().lower()
    return None
