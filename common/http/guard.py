"""Per-endpoint request counting and one log line for every error answer of an engine server.

Pure ASGI, not @app.middleware("http"): Starlette's BaseHTTPMiddleware hides http.disconnect from
request.is_disconnected(), so a plain request whose client (the router) left was never aborted.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from common.engine.metrics import EngineMetrics
from common.wire.errors import TandemError

log = logging.getLogger("tandem.http")


class CountingGuard:
    def __init__(self, app: ASGIApp, metrics: EngineMetrics, open_paths: frozenset[str]) -> None:
        self.app, self.metrics, self.open_paths = app, metrics, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), 500

        async def send_noting_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except TandemError as e:
            await JSONResponse(e.to_dict(), status_code=e.status, headers=e.headers)(scope, receive, send_noting_status)
        self._count(scope, status, start)

    def _count(self, scope: Scope, status: int, start: float) -> None:
        path = scope["path"]
        if _is_rejected_input(status):
            self.metrics.count_rejection("http")
        if path not in self.open_paths:
            endpoint = (
                path if path in _route_paths(scope["app"]) else "other"
            )  # bounded label values, whatever clients send
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if status >= 400:
                log.info("%s %s -> %d (%.1f ms)", scope["method"], path, status, 1000 * (time.monotonic() - start))


def _route_paths(app: FastAPI) -> set[str]:
    if not hasattr(app.state, "route_paths"):
        app.state.route_paths = {getattr(route, "path", "") for route in app.routes}
    return app.state.route_paths


def _is_rejected_input(status: int) -> bool:
    # 499 is no answer to bad input: the client left before the response was ready
    return 400 <= status < 500 and status != 499
