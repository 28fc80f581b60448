"""The engine servers' Starlette adapters of the wire rules (common/wire/): the API-key and drain middlewares
(pure ASGI: a BaseHTTPMiddleware would stand between streaming responses and client disconnects), the body
reader and the SSE response."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from common.wire.auth import bearer_matches, unauthorized
from common.wire.body import read_limited
from common.wire.drain import Drain, refusal
from common.wire.errors import RequestAborted


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


class DrainGuard:
    """ASGI middleware: counts requests in flight; while draining, refuses the drain's paths."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] in self.drain.refused:
            body, headers = refusal()
            await JSONResponse(body, 503, headers=headers)(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body of a Starlette request (see read_limited); a client that left before sending all of
    it is RequestAborted (499), no server fault."""
    try:
        return await read_limited(request.headers, request.stream(), limit)
    except ClientDisconnect:
        raise RequestAborted("the client disconnected before its request body was complete", param="body") from None


def sse_response(stream: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
