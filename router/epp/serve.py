"""Running `tandem epp`: the ext_proc gRPC server the gateway calls (--grpc-port; with the gRPC health services the
protocol names: liveness, readiness and envoy.service.ext_proc.v3.ExternalProcessor) and an HTTP port (--port:
/health, /readiness, /metrics), on one event loop with the picker's background rounds. SIGTERM or SIGINT stops it:
the gRPC server lets the streams in flight finish for GRACE_S."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import grpc
from aiohttp import web
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import add_ExternalProcessorServicer_to_server
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.wire.errors import error_body
from router.dispatch import json_response
from router.epp.config import EppConfig
from router.epp.ext_proc import ExtProc
from router.epp.picker import Picker

GRACE_S = 1.0
READY_POLL_S = 0.5
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def serve_epp(config: EppConfig) -> None:
    asyncio.run(_serve(config))


async def _serve(config: EppConfig) -> None:
    picker = Picker(config)
    headers = {"Authorization": f"Bearer {config.worker_key}"} if config.worker_key else None
    session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30, sock_connect=5))
    tasks = picker.tasks(session)
    server = grpc.aio.server()
    add_ExternalProcessorServicer_to_server(ExtProc(picker), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    await server.start()
    runner = web.AppRunner(http_app(picker), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks.append(asyncio.create_task(_follow_readiness(picker, checks)))
    try:
        await stop.wait()
    finally:
        await server.stop(GRACE_S)
        for task in tasks:
            task.cancel()
        await runner.cleanup()
        await session.close()


async def _follow_readiness(picker: Picker, checks: health.aio.HealthServicer) -> None:
    """The gRPC health answers: liveness always serving; readiness and ext_proc while a request can be placed."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    await checks.set("liveness", serving)
    await checks.set("", serving)
    while True:
        status = serving if picker.ready() else not_serving
        for service in ("readiness", EXT_PROC_SERVICE):
            await checks.set(service, status)
        await asyncio.sleep(READY_POLL_S)


def http_app(picker: Picker) -> web.Application:
    async def alive(request: web.Request) -> web.Response:
        return web.Response()

    async def readiness(request: web.Request) -> web.Response:
        healthy = {role: len(picker.workers.healthy(role)) for role in ("prefill", "decode")}
        if picker.ready():
            return json_response({"status": "ready", **healthy})
        message = f"not ready: {healthy['prefill']} healthy prefill and {healthy['decode']} healthy decode or servers"
        return json_response(error_body(message, "overloaded_error", 503), 503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=picker.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def workers(request: web.Request) -> web.Response:
        return json_response({"workers": [w.to_dict() for w in picker.workers.workers.values()]})

    app = web.Application()
    for path, handler in (("/health", alive), ("/readiness", readiness), ("/metrics", metrics), ("/workers", workers)):
        app.router.add_get(path, handler)
    return app
