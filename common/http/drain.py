"""Draining an engine server on SIGTERM (the mechanism: common/wire/drain.py): what a draining server
refuses, and how the requests still running at the deadline end."""

from __future__ import annotations

import asyncio

from common.engine.engine import Engine
from common.wire.drain import Drain

# new generations, and the health paths: routers stop sending and kubelets mark the pod not ready
REFUSED_WHILE_DRAINING = frozenset(
    {"/generate", "/v1/completions", "/v1/chat/completions", "/health", "/health_generate"}
)


def engine_drain(engine: Engine) -> Drain:
    return Drain(engine.config.drain_timeout_s, REFUSED_WHILE_DRAINING)


async def fail_in_flight(engine: Engine) -> None:
    """End every request the scheduler still holds with a 503 its client can act on (retry elsewhere)."""
    message = (
        f"this server shut down before the request finished (drain timeout {engine.config.drain_timeout_s:g} s); "
        "retry it"
    )

    def fail_all() -> None:
        scheduler = engine.scheduler
        for req in scheduler.tracked_requests():
            scheduler.abort_now(req, message, 503)

    await asyncio.wrap_future(engine.run_on_scheduler(fail_all))
