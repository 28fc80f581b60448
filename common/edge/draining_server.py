"""The engine servers' uvicorn.Server: its first SIGTERM drains (common/wire/drain.py) instead of closing the
port; a second SIGTERM, or SIGINT, is uvicorn's own shutdown."""

from __future__ import annotations

import signal
import time
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from common.wire.drain import Drain


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains (see the module docstring) instead of closing the port."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        on_timeout: Callable[[], Awaitable[None]] | None = None,
        on_start: Callable[[], Awaitable[None]] | None = None,
    ):
        """`on_start`: run once the drain began (a decode hands its movable requests back); `on_timeout`: at
        its deadline."""
        super().__init__(config)
        self.drain = drain
        self.on_timeout, self.on_start = on_timeout, on_start

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or not self.drain.on_sigterm():
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and not self.should_exit:
            if self.on_start is not None:
                on_start, self.on_start = self.on_start, None
                await on_start()
            step = self.drain.next_step(time.monotonic())
            if step == "exit":
                self.should_exit = True
            elif step == "end_requests" and self.on_timeout is not None:
                await self.on_timeout()
        return await super().on_tick(counter)
