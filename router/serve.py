"""Running the router: one process on the port, or with `--processes N` a supervisor and N processes
(router/processes.py); uvloop's event loop where it is installed.

Stopping, as every Tandem server (common/wire/drain.py): the first SIGTERM drains (new generations and
/readiness are answered 503 + X-Tandem-Draining, requests in flight run on for up to --drain-timeout-s,
the process exits with 0 once none is left, or FLUSH_S after the timeout); a second SIGTERM, or SIGINT,
stops at once.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

from aiohttp import web

from common.edge.tls import behind_tls
from common.wire.body import ARRIVAL_TIMEOUT_S
from common.wire.drain import FLUSH_S
from router.app import create_router_app, router_drain
from router.config import RouterConfig
from router.processes import shared_dir, supervise
from router.tls import listener_context

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
    # keepalive_timeout is aiohttp's deadline for a complete request head, counted from the connection's start
    # and from each answer: a connection that sends nothing, or half a head, is closed then. Bodies are
    # forwarded as sent, never decompressed (a compressed one is refused: common/wire/body.py).
    runner = web.AppRunner(
        create_router_app(config, drain),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=1,
        keepalive_timeout=ARRIVAL_TIMEOUT_S,
        auto_decompress=False,
    )
    await runner.setup()
    listener = await _listen(runner, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: drain.on_sigterm() or stop.set())
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:  # at the deadline the router has nothing of its own to end: exiting cancels what is left
        while not stop.is_set() and not (drain.draining and drain.next_step(time.monotonic()) == "exit"):
            await asyncio.sleep(TICK_S)
    finally:
        if listener is not None:
            listener.close()
        await runner.cleanup()


async def _listen(runner: web.AppRunner, config: RouterConfig) -> asyncio.Server | None:
    """Plain HTTP through aiohttp's site (None: the runner closes it); with --ssl-certfile, a listener that
    hands TLS connections to the app and answers plain HTTP with a 400 naming `scheme` (common/edge/tls.py)."""
    tls = listener_context(config)
    if tls is None:
        await web.TCPSite(runner, config.host, config.port, reuse_port=bool(shared_dir())).start()
        return None
    return await asyncio.get_running_loop().create_server(
        behind_tls(runner.server, tls), config.host, config.port, reuse_port=bool(shared_dir())
    )


def _event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's where it is installed: less CPU per request than asyncio's (benchmarks/router_bench.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
