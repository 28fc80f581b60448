"""Graceful stop on SIGTERM, for every Tandem HTTP server (engine servers and the router).

The first SIGTERM starts draining: requests to the `refused` paths (new generations, and the health
paths that routers and kubelets watch) are answered 503 with Retry-After and the X-Tandem-Draining
header, so routers retry elsewhere and take the server out of rotation without cutting what runs on
it; requests already in flight run on for up to `timeout_s`; then `on_timeout` ends what is left
(their clients get an error, not a cut connection) and the server exits with code 0 once they have
answered, or FLUSH_S later. A second SIGTERM, or SIGINT, stops at once (uvicorn's own shutdown).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from common.wire.errors import Unavailable

log = logging.getLogger("tandem.drain")
DRAINING_HEADER = "X-Tandem-Draining"
FLUSH_S = 5.0  # after on_timeout, for the ended requests' answers to reach their clients


class Drain:
    """The drain state one server's middleware and its uvicorn server share."""

    def __init__(self, timeout_s: float, refused: frozenset[str]):
        self.timeout_s = timeout_s
        self.refused = refused
        self.in_flight = 0  # HTTP requests being served (a streamed answer counts until its last byte)
        self.deadline: float | None = None
        self._ended = False  # the requests left at the deadline were ended

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def start(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s

    def on_sigterm(self) -> bool:
        """The first SIGTERM starts draining (True); a later one means stop now (False)."""
        if self.draining:
            return False
        log.info("SIGTERM: draining; %d requests in flight get up to %g s", self.in_flight, self.timeout_s)
        self.start()
        return True

    def next_step(self, now: float) -> str | None:
        """While draining: "exit" once nothing is in flight or FLUSH_S after the deadline, "end_requests"
        once at the deadline (the server ends what is left, so its clients get an error), else None."""
        if self.in_flight == 0:
            log.info("drained: no request in flight; exiting")
            return "exit"
        if now >= self.deadline + FLUSH_S:
            log.warning("%d requests still in flight; exiting anyway", self.in_flight)
            return "exit"
        if now >= self.deadline and not self._ended:
            self._ended = True
            log.warning("%d requests still in flight after %g s; ending them", self.in_flight, self.timeout_s)
            return "end_requests"
        return None


def refusal() -> tuple[dict, dict[str, str]]:
    """The JSON body and the headers of a draining server's 503."""
    error = Unavailable("this server is shutting down and takes no new requests; retry on another server")
    return error.to_dict(), {**error.headers, DRAINING_HEADER: "1"}


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


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains (see the module docstring) instead of closing the port."""

    def __init__(self, config: uvicorn.Config, drain: Drain, on_timeout: Callable[[], Awaitable[None]] | None = None):
        super().__init__(config)
        self.drain = drain
        self.on_timeout = on_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or not self.drain.on_sigterm():
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and not self.should_exit:
            step = self.drain.next_step(time.monotonic())
            if step == "exit":
                self.should_exit = True
            elif step == "end_requests" and self.on_timeout is not None:
                await self.on_timeout()
        return await super().on_tick(counter)
