"""Draining an engine server on SIGTERM (the mechanism: common/wire/drain.py): what a draining server
refuses, how a decode hands its movable requests back at once, and how the requests still running at the
deadline end."""

from __future__ import annotations

import asyncio
import logging

from common.config import ServerConfig
from common.engine.engine import Engine
from common.wire.drain import Drain

log = logging.getLogger("tandem.drain")

# new generations, and the health paths: routers stop sending and kubelets mark the pod not ready
REFUSED_WHILE_DRAINING = frozenset(
    {"/generate", "/v1/completions", "/v1/chat/completions", "/health", "/health_generate"}
)


def engine_drain(config: ServerConfig) -> Drain:
    """The drain of a server: --drain-timeout-s, and the paths it refuses meanwhile."""
    return Drain(config.drain_timeout_s, REFUSED_WHILE_DRAINING)


async def hand_over(engine: Engine) -> None:
    """At the drain's start, a decode ends every request the router may move elsewhere (its `migration` says
    the router had another decode: common/wire/migration.py) with a 503 at once: the router moves it to another
    pair, which goes on from the tokens shown, so the server exits within seconds whatever its streams' length.
    Others run on to the deadline. A prefill keeps its requests: they end once their KV is sent."""
    if engine.config.disaggregation_mode != "decode":
        return
    message = "this decode server is shutting down; the router moves the request to another pair"

    def end_movable() -> None:
        scheduler = engine.scheduler
        movable = [req for req in scheduler.tracked_requests() if req.migration is not None and req.migration.handover]
        for req in movable:
            scheduler.abort_now(req, message, 503)
        log.info("handed %d requests back to the router to move at once", len(movable))

    await asyncio.wrap_future(engine.run_on_scheduler(end_movable))


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
