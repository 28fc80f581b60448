"""Graceful stop on SIGTERM, for every Tandem HTTP server (engine servers and the router).

The first SIGTERM starts draining: requests to the `refused` paths (new generations, and the health
paths that routers and kubelets watch) are answered 503 with Retry-After and the X-Tandem-Draining
header, so routers retry elsewhere and take the server out of rotation without cutting what runs on
it; requests already in flight run on for up to `timeout_s`; then `on_timeout` ends what is left
(their clients get an error, not a cut connection) and the server exits with code 0 once they have
answered, or FLUSH_S later. A second SIGTERM, or SIGINT, stops at once.

This module is the drain's state and its 503, free of any HTTP framework; the engine servers' uvicorn and
Starlette adapters are in common/edge/ (draining_server.py, asgi.py), the router's in router/app.py and
router/serve.py.
"""

from __future__ import annotations

import logging
import time

from common.wire.errors import Unavailable

log = logging.getLogger("tandem.drain")
DRAINING_HEADER = "X-Tandem-Draining"
FLUSH_S = 5.0  # after on_timeout, for the ended requests' answers to reach their clients


class Drain:
    """The drain state one server's middleware and its serving loop share."""

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
