"""Bootstrap registry server (aiohttp, SGLang-compatible routes): prefill instances register their
control endpoint and KV layout; decode ranks look them up (state in bootstrap/registry.py).

    PUT    /route                                   register or refresh (every heartbeat interval)
    GET    /route?instance_id=I                     that instance's entry (what a decode asks for)
    GET    /route?engine_rank=R&target_dp_group=G   the one instance with that rank (409 if several)
    GET    /route?engine_rank=-1&target_dp_group=-1 the parallel layout
    DELETE /route?instance_id=I | ?engine_rank=R&target_dp_group=G   deregister
    GET    /health
    GET    /metrics                                 Prometheus: rejected requests, registered ranks

With a cluster secret, every /route request must be signed with it (bootstrap/signing.py): unsigned,
forged, stale and replayed requests answer 401 naming `signature`. Every rejected request answers a JSON
error naming the field at fault and is counted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from bootstrap.registry import (
    MAX_BODY_BYTES,
    RegistrationError,
    Registry,
    parse_instance,
    parse_ranks,
    validate_registration,
)
from common.edge.prometheus import render
from common.edge.tls import behind_tls
from common.wire.body import ARRIVAL_TIMEOUT_S, load_json_object, read_limited
from common.wire.errors import BodyTimeout, InvalidRequest, PayloadTooLarge, UnsupportedEncoding, error_body

log = logging.getLogger("tandem.bootstrap")

# a connection with no complete request head this long after it opened (or after its previous answer) is
# closed; bodies are read as sent (a compressed one is refused: common/wire/body.py)
SERVER_ARGS = {"keepalive_timeout": ARRIVAL_TIMEOUT_S, "auto_decompress": False}
STATUS_TYPES = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error"}


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return web.json_response(error_body(message, kind, status, param), status=status)


async def _read_body(request: web.Request) -> bytes:
    try:
        return await read_limited(request.headers, request.content.iter_any(), MAX_BODY_BYTES)
    except (
        PayloadTooLarge,
        BodyTimeout,
        UnsupportedEncoding,
    ) as e:  # 413; 408: a body still arriving after its deadline; 415
        raise RegistrationError(e.param or "body", e.message, e.status) from None


def _parse_json(raw: bytes) -> Any:
    try:
        return load_json_object(raw)
    except InvalidRequest as e:
        raise RegistrationError(e.param or "body", e.message) from None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(registry: Registry) -> web.Application:
    reg = registry
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors_as_json(reg)])

    async def put_route(request: web.Request) -> web.Response:
        raw = await _read_body(request)
        reg.check_signature(request, raw)
        entry = validate_registration(_parse_json(raw))
        if reg.register(entry):  # prefills re-register every heartbeat: log only news
            log.info(
                "registered prefill %s rank %s at %s:%s",
                entry["instance_id"] or "(no id)",
                entry["tp_rank"],
                entry["rank_ip"],
                entry["rank_port"],
            )
        return web.json_response({"ok": True})

    async def get_route(request: web.Request) -> web.Response:
        reg.check_signature(request)
        instance = parse_instance(request.query)
        rank, dp = parse_ranks(request.query)
        if instance is not None:
            entry = reg.by_instance(instance)
            missing = f"prefill instance {instance} is not registered (not started yet, restarted, or gone)"
        elif (rank, dp) == (-1, -1):
            entry, missing = reg.layout(), "no prefill rank has registered yet"
        else:
            entry, missing = reg.by_rank(rank, dp), f"prefill rank {rank} of dp group {dp} has not registered yet"
        if entry is None:  # not a rejection: decode polls while the prefill starts
            return _error(404, missing)
        return web.json_response(entry)

    async def delete_route(request: web.Request) -> web.Response:
        reg.check_signature(request)
        reg.remove(parse_instance(request.query), parse_ranks(request.query))
        return web.json_response({"ok": True})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "registered": len(reg.live_entries()), "rejected": reg.rejected})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=render(reg.metrics, "bootstrap"), content_type="text/plain", charset="utf-8")

    app.router.add_put("/route", put_route)
    app.router.add_get("/route", get_route)
    app.router.add_delete("/route", delete_route)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def _errors_as_json(reg: Registry) -> Callable:
    """Refusals are counted JSON errors; aiohttp's own (unknown path, bad method) and bugs answer JSON too."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RegistrationError as e:
            reg.count_rejection(request.method, e.field)
            log.info("rejected %s %s: %s", request.method, request.path, e)
            return _error(e.status, str(e), e.field)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            param = {404: "path", 405: "method", 413: "body"}.get(e.status)
            return _error(e.status, f"{request.method} {request.path}: {e.reason}", param)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return _error(500, "internal error; the bootstrap log has the details")

    return middleware


async def listen(registry: Registry, host: str, port: int, tls: ssl.SSLContext | None = None) -> web.AppRunner:
    """Serve `registry` on host:port on the running loop (HTTPS with `tls`, answering plain HTTP with a 400)."""
    runner = web.AppRunner(make_app(registry), **SERVER_ARGS)
    await runner.setup()
    if tls is None:
        await web.TCPSite(runner, host, port).start()
    else:
        await asyncio.get_running_loop().create_server(behind_tls(runner.server, tls), host, port)
    return runner


def run_bootstrap(host: str, port: int, secret: str | None = None, tls: ssl.SSLContext | None = None) -> None:
    """The standalone registry (`tandem bootstrap`, which checked the port): serves until SIGTERM or SIGINT."""
    logging.basicConfig(
        level=os.environ.get("TANDEM_LOG_LEVEL", "INFO"),
        format="%(asctime)s [bootstrap] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(listen(Registry(secret), host, port, tls))
    log.info("bootstrap server on %s://%s:%d", "https" if tls else "http", host, port)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, loop.stop)
    loop.run_forever()
    loop.run_until_complete(runner.cleanup())


def start_in_thread(host: str, port: int, secret: str | None, tls: ssl.SSLContext | None = None) -> Registry:
    """Embedded mode (the default for a prefill server): serve the registry on its own thread and
    event loop. Returns the registry, whose `rejected` count the prefill reports in its /metrics."""
    registry = Registry(secret)
    ready = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(listen(registry, host, port, tls))
        except BaseException as e:  # port in use, most likely
            failure.append(e)
            ready.set()
            return
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, name="bootstrap", daemon=True).start()
    if not ready.wait(10):
        raise RuntimeError(f"embedded bootstrap server did not start listening on {host}:{port} within 10 s")
    if failure:
        raise RuntimeError(f"embedded bootstrap server could not listen on {host}:{port}: {failure[0]}")
    return registry
