"""The API key (`Authorization: Bearer <key>`) of every Tandem HTTP server, checked in constant time by a
pure ASGI middleware (a BaseHTTPMiddleware would stand between streaming responses and client disconnects)."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from common.wire.errors import error_body


class ApiKeyGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, open_paths: frozenset[str]):
        self.app, self.api_key, self.open_paths = app, api_key, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.api_key or scope["path"] in self.open_paths or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        await JSONResponse(unauthorized(), 401)(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        return bearer_matches(Headers(scope=scope).get("authorization", ""), self.api_key)


def unauthorized() -> dict:
    """The 401 body of a request without the right key (servers, router)."""
    return error_body(
        "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error", 401, "authorization"
    )


def bearer_matches(header: str, key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())
