"""The router's HTTP front (FastAPI): OpenAI + SGLang endpoints over PD pairs, health, workers, metrics."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.errors import error_body
from router.config import RouterConfig
from router.policies import make_policy
from router.proxy import Pair, UpstreamError, complete, log_request, start_pair, stream, with_bootstrap
from router.workers import WorkerRegistry

log = logging.getLogger("tandem.router")
GEN_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
OPEN_PATHS = {"/health", "/readiness", "/metrics"}


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tandem_router_requests", "requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.upstream_errors = Counter("tandem_router_upstream_errors", "errors from workers", ["role"], registry=r)
        self.latency = Histogram("tandem_router_request_latency_seconds", "request latency", registry=r)
        healthy = Gauge("tandem_router_healthy_workers", "healthy workers by role", ["role"], registry=r)
        for role in ("prefill", "decode"):
            healthy.labels(role).set_function(lambda role=role: len(workers.healthy(role)))


def create_router_app(config: RouterConfig) -> FastAPI:
    workers = WorkerRegistry(config.health_failure_threshold)
    for p in config.prefill:
        workers.add(p.url, "prefill", p.bootstrap_port)
    for d in config.decode:
        workers.add(d, "decode")
    prefill_policy = make_policy(config.policy)
    decode_policy = make_policy("power_of_two" if config.policy == "cache_aware" else config.policy)
    metrics = RouterMetrics(workers)
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=5)
        state["session"] = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        task = asyncio.create_task(workers.health_loop(state["session"], config.health_check_interval_s))
        yield
        task.cancel()
        await state["session"].close()

    app = FastAPI(title="Tandem router", lifespan=lifespan)
    app.state.workers = workers

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if config.api_key and request.url.path not in OPEN_PATHS:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), config.api_key.encode()):
                return JSONResponse(error_body("missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error", 401, "authorization"), 401)
        if int(request.headers.get("content-length") or 0) > config.max_request_bytes:
            return JSONResponse(error_body(f"request body exceeds {config.max_request_bytes} bytes", "invalid_request_error", 413, "body"), 413)
        return await call_next(request)

    def pick_pair(key: str, exclude: set[str]) -> Pair | None:
        prefills = [w for w in workers.healthy("prefill") if w.url not in exclude]
        decodes = [w for w in workers.healthy("decode") if w.url not in exclude]
        if not prefills or not decodes:
            return None
        return Pair(prefill_policy.pick(prefills, key), decode_policy.pick(decodes, key))

    async def route(path: str, request: Request) -> Response:
        start = time.monotonic()
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _reply(path, JSONResponse(error_body(f"request body is not valid JSON: {e}", "invalid_request_error", 400, "body"), 400), None, start)
        if not isinstance(body, dict):
            return _reply(path, JSONResponse(error_body("request body must be a JSON object", "invalid_request_error", 400, "body"), 400), None, start)
        key = _prompt_key(body)
        exclude: set[str] = set()
        for attempt in range(2):
            pair = pick_pair(key, exclude)
            if pair is None:
                msg = "no healthy prefill and decode worker pair is available; retry later"
                return _reply(path, JSONResponse(error_body(msg, "overloaded_error", 503), 503, headers={"Retry-After": "1"}), None, start)
            pair.prefill.in_flight += 1
            pair.decode.in_flight += 1
            try:
                return await forward(path, with_bootstrap(body, pair.prefill), pair, start)
            except UpstreamError as e:
                metrics.upstream_errors.labels(e.worker.role if e.worker else "router").inc()
                if e.refused and attempt == 0 and e.worker is not None:
                    exclude.add(e.worker.url)
                    workers.mark(e.worker, False)
                    continue
                return _reply(path, Response(e.body, e.status, media_type="application/json"), pair, start)
            finally:
                pair.prefill.in_flight -= 1
                pair.decode.in_flight -= 1
        raise AssertionError("unreachable")

    async def forward(path: str, body: dict, pair: Pair, start: float) -> Response:
        session = state["session"]
        if body.get("stream"):
            resp, prefill = await start_pair(session, pair, path, body)
            _reply(path, Response(status_code=200), pair, start)
            return StreamingResponse(stream(session, resp, prefill), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        data = await complete(session, pair, path, body)
        return _reply(path, Response(data, 200, media_type="application/json"), pair, start)

    def _reply(path: str, response: Response, pair: Pair | None, start: float) -> Response:
        metrics.requests.labels(path, str(response.status_code)).inc()
        metrics.latency.observe(time.monotonic() - start)
        log_request(path, pair, response.status_code, start)
        return response

    for gen_path in GEN_PATHS:
        app.add_api_route(gen_path, _bind(route, gen_path), methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        for w in workers.healthy("decode"):
            try:
                async with state["session"].get(w.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
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
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/workers")
    async def list_workers() -> dict:
        return {"workers": [w.to_dict() for w in workers.workers.values()]}

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            w = workers.add(str(body["url"]), str(body["role"]), body.get("bootstrap_port"))
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse(error_body(f"give url, role (prefill|decode) and, for prefill, bootstrap_port: {e}", "invalid_request_error", 400, "body"), 400)
        await workers.check_all(state["session"])
        return JSONResponse(w.to_dict())

    @app.delete("/workers")
    async def remove_worker(request: Request) -> Response:
        try:
            url = str(json.loads(await request.body())["url"])
        except (ValueError, KeyError, TypeError):
            return JSONResponse(error_body("give the url of the worker to remove", "invalid_request_error", 400, "url"), 400)
        if not workers.remove(url):
            return JSONResponse(error_body(f"no worker {url}", "not_found_error", 404, "url"), 404)
        return JSONResponse({"removed": url})

    return app


def _bind(route, path: str):
    async def handler(request: Request) -> Response:
        return await route(path, request)

    return handler


def _prompt_key(body: dict) -> str:
    for key in ("text", "prompt"):
        if isinstance(body.get(key), str):
            return body[key]
    if isinstance(body.get("messages"), list):
        return json.dumps(body["messages"])[:4096]
    if isinstance(body.get("input_ids"), list):
        return ",".join(map(str, body["input_ids"][:1024]))
    return ""
