"""`tandem sidecar --decode URL --port P`: the pair sidecar on a decode pod, one pod's worth of the router's pair logic.

The gateway sends each request to the pod the endpoint picker chose, here. With x-prefiller-host-port (llm-d's
header: the prefill the picker paired this decode with) the request runs as the router runs a pair: both halves at
once through the router's Dispatcher (router/dispatch.py: PairCall, PairStream, one retry, the reply plain or
streamed), the decode reading the prompt's KV from that prefill. Without the header, or when that prefill is down,
the decode computes the prompt itself (pd_placement local). A prefill is learned on its first request (one /health:
its bootstrap registry) and health-checked from then on like the router's workers.

With `TANDEM_API_KEY` set, a generation request must carry it (Authorization: Bearer), and the sidecar sends it to the
prefill and its decode (or `--worker-api-key`'s). Every other GET (/health, /metrics, /get_server_info, /v1/models) is the decode's own answer, so the picker reads the
decode's health, load and KV events through this port as the pool's endpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

import aiohttp
from aiohttp import web

from common.wire.auth import bearer_matches, unauthorized
from common.wire.errors import TandemError
from router.admission import Admission
from router.config import RouterConfig
from router.dispatch import Dispatcher, json_response
from router.http1 import Pools
from router.metrics import RouterMetrics
from router.pair_call import Pair
from router.request_hints import NONE, RequestHints
from router.workers import Worker, WorkerRegistry

GEN_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
SESSION = web.AppKey("session", aiohttp.ClientSession)
PASSED = ("/health", "/metrics", "/get_server_info", "/v1/models")


class PrefillerPlacer:
    """The pair the gateway's picker chose: the prefill the request's header names, with this pod's decode."""

    def __init__(self, workers: WorkerRegistry, decode: Worker):
        self.workers, self.decode = workers, decode

    def prefill_of(self, hints: RequestHints) -> str | None:
        return f"http://{hints.prefiller}" if hints.prefiller else None

    def pick(self, body: dict[str, Any], exclude: Collection[str] = (), hints: RequestHints = NONE) -> Pair | None:
        if not self.decode.healthy or self.decode.url in exclude:
            return None
        prefill = self.workers.workers.get(self.prefill_of(hints) or "")
        if prefill is not None and prefill.healthy and prefill.url not in exclude:
            return Pair(prefill, self.decode)
        return Pair(None, self.decode, "local", "no_prefill")

    def first_token(self, pair: Pair, seconds: float) -> None:
        """Nothing to learn: the picker placed it."""

    async def learn(self, session: aiohttp.ClientSession, hints: RequestHints) -> None:
        """A prefill seen for the first time: registered and checked at once (its /health names its registry)."""
        url = self.prefill_of(hints)
        if url is not None and url not in self.workers.workers:
            await self.workers.check(session, self.workers.add(url, "prefill"))


def create_sidecar_app(config: RouterConfig) -> web.Application:
    workers = WorkerRegistry(config.health_failure_threshold, config.health_check_timeout_s)
    decode = workers.add(config.decode[0], "decode")
    admission = Admission(config.max_concurrent_requests)
    metrics = RouterMetrics(workers, lambda: admission.in_flight)
    placer = PrefillerPlacer(workers, decode)
    dispatcher = Dispatcher(config, workers, metrics, admission, Pools(config.worker_key), placer)  # type: ignore[arg-type]
    app = web.Application()

    async def generate(request: web.Request) -> web.StreamResponse:
        if config.api_key and not bearer_matches(request.headers.get("Authorization", ""), config.api_key):
            return json_response(unauthorized(), 401)
        try:
            hints = RequestHints.from_headers(request.headers)
        except TandemError as e:
            return json_response(e.to_dict(), e.status, e.headers)
        await placer.learn(app[SESSION], hints)
        return await dispatcher.handle(request)

    async def passed(request: web.Request) -> web.Response:
        async with app[SESSION].get(decode.url + request.raw_path) as r:
            headers = {
                k: v
                for k, v in r.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection")
            }
            return web.Response(body=await r.read(), status=r.status, headers=headers)

    async def lifespan(app: web.Application):
        headers = {"Authorization": f"Bearer {config.worker_key}"} if config.worker_key else None
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=5)
        session = app[SESSION] = aiohttp.ClientSession(headers=headers, timeout=timeout, auto_decompress=False)
        await workers.check_all(session)
        task = asyncio.create_task(workers.health_loop(session, config.health_check_interval_s))
        yield
        task.cancel()
        dispatcher.pools.close()
        await session.close()

    app.cleanup_ctx.append(lifespan)
    for path in GEN_PATHS:
        app.router.add_post(path, generate)
    for path in PASSED:
        app.router.add_get(path, passed)
    app.router.add_get("/v1/models/{model_id:.+}", passed)
    return app


def serve_sidecar(config: RouterConfig) -> None:
    web.run_app(create_sidecar_app(config), host=config.host, port=config.port, access_log=None, print=None)
