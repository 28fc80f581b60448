"""Running the router: one process on the port, or with `--processes N` a supervisor and N processes
(router/processes.py); uvloop's event loop where it is installed.

Stopping, as every Tandem server (common/wire/drain.py): the first SIGTERM drains (new generations and
/readiness are answered 503 + X-Tandem-Draining, requests in flight run on for up to --drain-timeout-s,
the process exits with 0 once none is left, or FLUSH_S after the timeout); a second SIGTERM, or SIGINT,
stops at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

from aiohttp import web

from common.wire.drain import FLUSH_S, Drain
from router.app import create_router_app, router_drain
from router.config import RouterConfig
from router.processes import shared_dir, supervise

log = logging.getLogger("tandem.router")
TICK_S = 0.1


def serve_router(config: RouterConfig, argv: list[str]) -> None:
    """Serve until stopped (see the module docstring); `argv` are this command's flags, for its processes."""
    if config.processes > 1 and not shared_dir():
        sys.exit(supervise(argv, config.processes, config.drain_timeout_s + FLUSH_S))
    loop = _event_loop()
    try:
        loop.run_until_complete(_serve(config))
    finally:
        loop.close()


async def _serve(config: RouterConfig) -> None:
    drain = router_drain(config)
    runner = web.AppRunner(create_router_app(config, drain), handler_cancellation=True, access_log=None, shutdown_timeout=1)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port, reuse_port=bool(shared_dir())).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, _on_sigterm, drain, stop)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        while not stop.is_set() and not _drained(drain):
            await asyncio.sleep(TICK_S)
    finally:
        await runner.cleanup()


def _on_sigterm(drain: Drain, stop: asyncio.Event) -> None:
    if drain.draining:
        stop.set()
        return
    log.info("SIGTERM: draining; %d requests in flight get up to %g s", drain.in_flight, drain.timeout_s)
    drain.start()


def _drained(drain: Drain) -> bool:
    if not drain.draining:
        return False
    if drain.in_flight == 0:
        log.info("drained: no request in flight; exiting")
        return True
    if time.monotonic() >= drain.deadline + FLUSH_S:
        log.warning("%d requests still in flight %g s after SIGTERM; exiting anyway", drain.in_flight, drain.timeout_s + FLUSH_S)
        return True
    return False


def _event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's where it is installed: less CPU per request than asyncio's (benchmarks/router_bench.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
