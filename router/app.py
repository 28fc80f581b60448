"""The router's HTTP front (aiohttp.web): OpenAI + SGLang endpoints over PD pairs, health, workers, metrics.

aiohttp rather than FastAPI: the router reads a few fields of each body and passes the rest through, so it
needs no request models, and the lighter stack is most of its throughput (benchmarks/router_bench.py).
router/serve.py serves it: a client that goes away cancels its request's handler, SIGTERM drains.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from common.wire.api import parse_body
from common.wire.auth import bearer_matches, unauthorized
from common.wire.body import read_limited
from common.wire.drain import Drain, refusal
from common.wire.errors import InvalidRequest, TandemError, error_body
from common.wire.responses_call import Responses
from common.wire.responses_store import ResponsesStore
from common.wire.version import package_version
from router.admission import Admission
from router.cluster_status import health_generate, server_info
from router.config import RouterConfig, WorkerChange
from router.discovery import Discovery, targets_from_config
from router.dispatch import Dispatcher, json_response
from router.http1 import Pools
from router.lora_fanout import add_lora_fanout_routes
from router.metrics import REFRESH_S, RouterMetrics
from router.placement.kv_feeds import KVFeeds
from router.placement.kv_index import KVIndex
from router.placement.kv_policy import KVAwarePolicy
from router.placement.placer import Placer, pair_policy, placement_rule
from router.placement.worker_stats import WorkerStats
from router.processes import shared_dir
from router.responses import add_responses_routes
from router.role_switch import add_pd_role_switch_route
from router.shared_workers import SharedWorkers
from router.tls import client_context
from router.workers import WorkerRegistry

GEN_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
RESPONSES = "/v1/responses"  # a chat completion underneath (router/responses.py)
OPEN_PATHS = frozenset({"/health", "/readiness", "/metrics"})
# a draining router takes no new request, and fails /readiness so its Service stops sending any
REFUSED_WHILE_DRAINING = frozenset({*GEN_PATHS, RESPONSES, "/health_generate", "/readiness"})
ROUTING_PARAMS = {404: "path", 405: "method"}  # what a routing error is about, for its `param`


def router_drain(config: RouterConfig) -> Drain:
    return Drain(config.drain_timeout_s, REFUSED_WHILE_DRAINING)


def create_router_app(config: RouterConfig, drain: Drain | None = None) -> web.Application:
    """`drain`: the router's graceful stop (see router_drain); None in tests that never stop it."""
    workers = WorkerRegistry(config.health_failure_threshold, config.health_check_timeout_s, config.adapter_routing)
    for p in config.prefill:
        workers.add(p.url, "prefill", p.bootstrap_port, p.bootstrap_host)
    for d in config.decode:
        workers.add(d, "decode")
    discovery = Discovery(workers, targets_from_config(config))
    shared = shared_dir()  # set when this is one of several router processes on the port
    admission = Admission(
        math.ceil(config.max_concurrent_requests / config.processes) if shared else config.max_concurrent_requests
    )
    metrics = RouterMetrics(workers, lambda: admission.in_flight, os.path.join(shared, "metrics") if shared else None)
    tls = client_context(config)  # workers are called with the router's key for them, https ones verified
    feeds = metrics.kv_feeds = KVFeeds(workers, KVIndex())  # every policy counts what its pairs held
    kv = KVAwarePolicy(
        feeds.index, feeds, config.kv_load_tokens, metrics, config.kv_host_hit_weight, config.kv_store_hit_weight
    )
    stats = WorkerStats(workers, config.placement_poll_interval_s)  # scraped only for --pd-placement cost
    policy = pair_policy(config.policy, config.decode_policy, kv)
    rule = placement_rule(config.pd_placement, policy, kv, stats, config.placement_local_threshold)
    placer = Placer(workers, policy, kv, rule, metrics)
    dispatcher = Dispatcher(config, workers, metrics, admission, Pools(config.worker_key, tls), placer)
    app = web.Application(middlewares=[_guard(config.api_key, drain)])
    app["workers"], app["dispatcher"], app["kv_feeds"] = workers, dispatcher, feeds
    app["shared_workers"] = SharedWorkers(shared, workers) if shared else None

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=5)
        headers = {"Authorization": f"Bearer {config.worker_key}"} if config.worker_key else None
        # health checks, discovery, /v1/models, /get_server_info
        session = app["session"] = aiohttp.ClientSession(
            timeout=timeout, headers=headers, connector=aiohttp.TCPConnector(ssl=tls)
        )
        if shared:  # one of --processes N: it listens on a port its siblings serve, so it checks its workers
            await workers.check_all(session)  # first (else the kernel may hand it a client it answers 503)
        tasks = [asyncio.create_task(workers.health_loop(session, config.health_check_interval_s))]
        tasks.append(asyncio.create_task(feeds.follow(session)))
        if config.pd_placement == "cost":
            tasks.append(asyncio.create_task(stats.follow(session)))
        if discovery.targets:
            tasks.append(asyncio.create_task(discovery.run(session, config.discovery_interval_s)))
        if shared:
            tasks += [
                asyncio.create_task(app["shared_workers"].follow(session)),
                asyncio.create_task(_refresh(metrics)),
            ]
        yield
        for task in tasks:
            task.cancel()
        dispatcher.pools.close()
        await session.close()

    app.cleanup_ctx.append(lifespan)
    for gen_path in GEN_PATHS:
        app.router.add_post(gen_path, dispatcher.handle)
    store = ResponsesStore(config.responses_store_size, os.path.join(shared, "responses.sqlite") if shared else None)
    add_responses_routes(app, dispatcher, Responses(store), config.max_request_bytes)
    _add_status_routes(app, workers, metrics, config.max_request_bytes)
    _add_cluster_routes(app, config, workers, dispatcher)
    _add_worker_routes(app, workers, config.max_request_bytes)
    add_pd_role_switch_route(app, workers, config.max_request_bytes, config.pd_role_switch_timeout_s)
    add_lora_fanout_routes(app, workers, config.max_request_bytes)
    return app


async def _refresh(metrics: RouterMetrics) -> None:
    while True:
        metrics.refresh()
        await asyncio.sleep(REFRESH_S)


def _guard(api_key: str | None, drain: Drain | None):
    """The API key (Bearer; open paths need none), the drain (refuses new work, counts what runs) and every
    error as the JSON error body: one middleware, as each costs every request."""

    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        path = request.path
        if api_key and path not in OPEN_PATHS and not bearer_matches(request.headers.get("Authorization", ""), api_key):
            return json_response(unauthorized(), 401)
        if drain is not None and drain.draining and path in drain.refused:
            body, headers = refusal()
            return json_response(body, 503, headers)
        if drain is not None:
            drain.in_flight += 1
        try:
            return await handler(request)
        except TandemError as e:
            return json_response(e.to_dict(), e.status, e.headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            message = f"{request.method} {path}: {e.reason}"
            return json_response(
                error_body(message, "invalid_request_error", e.status, ROUTING_PARAMS.get(e.status)), e.status
            )
        finally:
            if drain is not None:
                drain.in_flight -= 1

    return guard


def _add_status_routes(app: web.Application, workers: WorkerRegistry, metrics: RouterMetrics, max_bytes: int) -> None:
    async def forwarded(request: web.Request) -> web.Response:
        """/v1/models, /get_model_info, /tokenize, /detokenize: a healthy worker's answer (a decode's first)."""
        body = (
            await read_limited(request.headers, request.content.iter_any(), max_bytes)
            if request.can_read_body
            else None
        )
        for w in [*workers.healthy("decode"), *workers.healthy("prefill")]:
            try:
                async with app["session"].request(
                    request.method,
                    w.url + request.raw_path,
                    data=body,
                    headers={"Content-Type": "application/json"} if body is not None else None,
                    timeout=aiohttp.ClientTimeout(total=5),
                    server_hostname=w.tls_name,
                ) as r:
                    return json_response(await r.read(), r.status)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return json_response(error_body("no healthy worker", "overloaded_error", 503), 503, {"Retry-After": "1"})

    async def router_version(request: web.Request) -> web.Response:
        return json_response({"version": package_version()})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def readiness(request: web.Request) -> web.Response:
        p, d = len(workers.healthy("prefill")), len(workers.healthy("decode"))
        if p and d:
            return json_response({"status": "ready", "prefill": p, "decode": d})
        return json_response(
            error_body(f"not ready: {p} healthy prefill and {d} healthy decode workers", "overloaded_error", 503), 503
        )

    async def prometheus(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    for path, handler in (
        ("/v1/models", forwarded),
        ("/get_model_info", forwarded),
        ("/version", router_version),
        ("/health", health),
        ("/readiness", readiness),
        ("/metrics", prometheus),
    ):
        app.router.add_get(path, handler)
    app.router.add_get("/v1/models/{model_id:.+}", forwarded)
    app.router.add_post("/tokenize", forwarded)
    app.router.add_post("/detokenize", forwarded)


def _add_cluster_routes(
    app: web.Application, config: RouterConfig, workers: WorkerRegistry, dispatcher: Dispatcher
) -> None:
    async def info(request: web.Request) -> web.Response:
        return json_response(await server_info(config, workers, app["session"]))

    async def generate_one(request: web.Request) -> web.Response:
        return await health_generate(dispatcher, request)

    app.router.add_get("/get_server_info", info)
    app.router.add_get("/health_generate", generate_one)


def _add_worker_routes(app: web.Application, workers: WorkerRegistry, max_bytes: int) -> None:
    async def body_of(request: web.Request) -> WorkerChange:
        raw = await read_limited(request.headers, request.content.iter_any(), max_bytes)
        return parse_body(raw, WorkerChange)

    async def list_workers(request: web.Request) -> web.Response:
        return json_response({"workers": [w.to_dict() for w in workers.workers.values()]})

    async def add_worker(request: web.Request) -> web.Response:
        change = await body_of(request)
        if change.role is None:
            raise InvalidRequest(
                "give url, role (prefill|decode) and, for prefill, bootstrap_port (and bootstrap_host "
                "for a standalone registry)",
                param="role",
            )
        w = workers.add(change.url, change.role, change.bootstrap_port, change.bootstrap_host)
        if app["shared_workers"]:
            app["shared_workers"].publish(added=w)
        await workers.check_all(app["session"])
        return json_response(w.to_dict())

    async def remove_worker(request: web.Request) -> web.Response:
        url = (await body_of(request)).url
        if not workers.remove(url):
            return json_response(error_body(f"no worker {url}", "not_found_error", 404, "url"), 404)
        if app["shared_workers"]:
            app["shared_workers"].publish(removed=url.rstrip("/"))
        return json_response({"removed": url})

    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    app.router.add_delete("/workers", remove_worker)
