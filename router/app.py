"""The router's HTTP front (FastAPI): OpenAI + SGLang endpoints over PD pairs, health, workers, metrics."""
from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.wire.auth import ApiKeyGuard
from common.wire.body import read_body
from common.wire.drain import Drain, DrainGuard
from common.wire.errors import InvalidRequest, TandemError, error_body
from router.admission import Admission
from router.config import RouterConfig
from router.discovery import Discovery, targets_from_config
from router.dispatch import Dispatcher
from router.metrics import RouterMetrics
from router.workers import WorkerRegistry

GEN_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
OPEN_PATHS = frozenset({"/health", "/readiness", "/metrics"})
# a draining router takes no new request, and fails /readiness so its Service stops sending any
REFUSED_WHILE_DRAINING = frozenset({*GEN_PATHS, "/readiness"})


def router_drain(config: RouterConfig) -> Drain:
    return Drain(config.drain_timeout_s, REFUSED_WHILE_DRAINING)


def create_router_app(config: RouterConfig, drain: Drain | None = None) -> FastAPI:
    """`drain`: the router's graceful stop (see router_drain); None in tests that never stop it."""
    workers = WorkerRegistry(config.health_failure_threshold, config.health_check_timeout_s)
    for p in config.prefill:
        workers.add(p.url, "prefill", p.bootstrap_port, p.bootstrap_host)
    for d in config.decode:
        workers.add(d, "decode")
    discovery = Discovery(workers, targets_from_config(config))
    admission = Admission(config.max_concurrent_requests)
    metrics = RouterMetrics(workers, lambda: admission.in_flight)
    dispatcher = Dispatcher(config, workers, metrics, admission)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=5)
        session = dispatcher.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        tasks = [asyncio.create_task(workers.health_loop(session, config.health_check_interval_s))]
        if discovery.targets:
            tasks.append(asyncio.create_task(discovery.run(session, config.discovery_interval_s)))
        yield
        for task in tasks:
            task.cancel()
        await session.close()

    app = FastAPI(title="Tandem router", lifespan=lifespan)
    app.state.workers = workers
    if drain is not None:
        app.add_middleware(DrainGuard, drain=drain)
    app.add_middleware(ApiKeyGuard, api_key=config.api_key, open_paths=OPEN_PATHS)

    @app.exception_handler(TandemError)
    async def _tandem_error(_: Request, exc: TandemError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)

    for gen_path in GEN_PATHS:
        app.add_api_route(gen_path, _bind(dispatcher, gen_path), methods=["POST"])
    _add_status_routes(app, workers, metrics, dispatcher)
    _add_worker_routes(app, workers, dispatcher, config.max_request_bytes)
    return app


def _bind(dispatcher: Dispatcher, path: str):
    async def handler(request: Request) -> Response:
        return await dispatcher.handle(path, request)

    return handler


def _add_status_routes(app: FastAPI, workers: WorkerRegistry, metrics: RouterMetrics, dispatcher: Dispatcher) -> None:
    @app.get("/v1/models")
    async def models() -> Response:
        for w in workers.healthy("decode"):
            try:
                async with dispatcher.session.get(w.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return Response(await r.read(), r.status, media_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return JSONResponse(error_body("no healthy decode worker", "overloaded_error", 503), 503, headers={"Retry-After": "1"})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/readiness")
    async def readiness() -> Response:
        p, d = len(workers.healthy("prefill")), len(workers.healthy("decode"))
        if p and d:
            return JSONResponse({"status": "ready", "prefill": p, "decode": d})
        return JSONResponse(error_body(f"not ready: {p} healthy prefill and {d} healthy decode workers", "overloaded_error", 503), 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")


def _add_worker_routes(app: FastAPI, workers: WorkerRegistry, dispatcher: Dispatcher, max_bytes: int) -> None:
    @app.get("/workers")
    async def list_workers() -> dict:
        return {"workers": [w.to_dict() for w in workers.workers.values()]}

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        try:
            body = json.loads(await read_body(request, max_bytes))
            if not isinstance(body.get("bootstrap_host"), (str, type(None))):
                raise TypeError("bootstrap_host must be a string")
            w = workers.add(str(body["url"]), str(body["role"]), body.get("bootstrap_port"), body.get("bootstrap_host"))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidRequest(f"give url, role (prefill|decode) and, for prefill, bootstrap_port (and bootstrap_host "
                                 f"for a standalone registry): {e}", param="body") from None
        await workers.check_all(dispatcher.session)
        return JSONResponse(w.to_dict())

    @app.delete("/workers")
    async def remove_worker(request: Request) -> Response:
        try:
            url = str(json.loads(await read_body(request, max_bytes))["url"])
        except (ValueError, KeyError, TypeError):
            raise InvalidRequest("give the url of the worker to remove", param="url") from None
        if not workers.remove(url):
            return JSONResponse(error_body(f"no worker {url}", "not_found_error", 404, "url"), 404)
        return JSONResponse({"removed": url})
