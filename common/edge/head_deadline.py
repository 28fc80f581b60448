"""A deadline on the request head for the engine servers' uvicorn: a connection whose complete request head
has not arrived --head-timeout-s (default ARRIVAL_TIMEOUT_S) after it opened, or after its previous response,
is closed (no answer, as
nginx closes an idle connection or a half-sent head), so a client holds no connection for long by sending
nothing or sending its head slowly. The body has the same deadline (common/wire/body.py).

uvicorn has no such knob: its timeout_keep_alive starts only after a response and stops at the first byte of
the next request. The router and the bootstrap registry get the same bound from aiohttp (keepalive_timeout).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from common.wire.body import ARRIVAL_TIMEOUT_S

log = logging.getLogger("tandem.http")


def with_head_deadline(timeout_s: float) -> type[HeadDeadlineProtocol]:
    """The protocol class with a server's own deadline (`--head-timeout-s`)."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout_s": timeout_s})


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol (`uvicorn.Config(http=HeadDeadlineProtocol)`) with the head deadline."""

    head_timeout_s = ARRIVAL_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()

    def on_response_complete(self) -> None:
        self._start_head_timer()  # first: a pipelined request that super() starts is a request in progress
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _start_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_overdue)

    def _head_overdue(self) -> None:
        self._head_timer = None
        waiting_for_head = self.cycle is None or self.cycle.response_complete  # else a request is in progress
        if waiting_for_head and not self.transport.is_closing():
            log.debug(
                "closing a connection from %s: no complete request head within %g s", self.client, self.head_timeout_s
            )
            self.transport.close()
