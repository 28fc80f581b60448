"""Bootstrap registry (aiohttp, SGLang-compatible routes): prefill ranks register their control
endpoint and KV layout; decode ranks look them up.

    PUT    /route                                   register (idempotent: a restart replaces)
    GET    /route?engine_rank=R&target_dp_group=G   one rank's entry; -1,-1: the parallel layout
    DELETE /route?engine_rank=R&target_dp_group=G   deregister
    GET    /health
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from typing import Any

from aiohttp import web

from common.errors import error_body

log = logging.getLogger("tandem.bootstrap")

FIELDS: dict[str, tuple[type, ...]] = {
    "role": (str,), "tp_size": (int,), "tp_rank": (int,), "dp_size": (int,), "dp_rank": (int,),
    "rank_ip": (str,), "rank_port": (int,), "page_size": (int,), "num_layers": (int,), "kv_heads": (int,),
    "head_dim": (int,), "dtype": (str,), "transfer_backend": (str,), "instance_id": (str,),
}
DEFAULTS = {"dp_size": 1, "dp_rank": 0, "instance_id": ""}
LAYOUT_KEYS = ("page_size", "num_layers", "kv_heads", "head_dim", "dtype", "transfer_backend")


class RegistrationError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_registration(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RegistrationError("body", "must be a JSON object")
    entry = DEFAULTS | {k: v for k, v in body.items() if k in FIELDS}
    for name, types in FIELDS.items():
        value = entry.get(name)
        if value is None:
            raise RegistrationError(name, "is required")
        if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
            raise RegistrationError(name, f"must be {types[0].__name__}")
    if entry["role"] != "Prefill":
        raise RegistrationError("role", "only 'Prefill' ranks register")
    if not 1 <= entry["rank_port"] <= 65535:
        raise RegistrationError("rank_port", "must be in 1..65535")
    for name in ("tp_size", "dp_size", "page_size", "num_layers", "kv_heads", "head_dim"):
        if entry[name] < 1:
            raise RegistrationError(name, "must be >= 1")
    if not 0 <= entry["tp_rank"] < entry["tp_size"] or not 0 <= entry["dp_rank"] < entry["dp_size"]:
        raise RegistrationError("tp_rank", "ranks must be inside their sizes")
    if not entry["rank_ip"] or len(entry["rank_ip"]) > 255:
        raise RegistrationError("rank_ip", "must be a host name or address")
    return entry


class Registry:
    def __init__(self, secret: str | None):
        self.secret = secret
        self.entries: dict[tuple[int, int], dict[str, Any]] = {}
        self.rejected = 0

    def authorized(self, request: web.Request, body: dict | None = None) -> bool:
        if self.secret is None:
            return True
        got = request.headers.get("X-Tandem-Secret") or (body or {}).get("secret") or ""
        return isinstance(got, str) and hmac.compare_digest(got.encode(), self.secret.encode())


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return web.json_response(error_body(message, kind, status, param), status=status)


def _ranks(request: web.Request) -> tuple[int, int]:
    try:
        return int(request.query.get("engine_rank", "0")), int(request.query.get("target_dp_group", "0"))
    except ValueError:
        raise RegistrationError("engine_rank", "engine_rank and target_dp_group must be integers") from None


def make_app(secret: str | None = None) -> web.Application:
    reg = Registry(secret)
    app = web.Application(client_max_size=64 * 1024)
    app["registry"] = reg

    async def put_route(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except Exception:
            reg.rejected += 1
            return _error(400, "body is not valid JSON", "body")
        if not reg.authorized(request, body if isinstance(body, dict) else None):
            reg.rejected += 1
            return _error(401, "missing or wrong cluster secret", "secret")
        try:
            entry = validate_registration(body)
        except RegistrationError as e:
            reg.rejected += 1
            return _error(400, str(e), e.field)
        reg.entries[(entry["tp_rank"], entry["dp_rank"])] = entry
        log.info("registered prefill rank %s at %s:%s", entry["tp_rank"], entry["rank_ip"], entry["rank_port"])
        return web.json_response({"ok": True})

    async def get_route(request: web.Request) -> web.Response:
        if not reg.authorized(request):
            return _error(401, "missing or wrong cluster secret", "secret")
        try:
            rank, dp = _ranks(request)
        except RegistrationError as e:
            return _error(400, str(e), e.field)
        if (rank, dp) == (-1, -1):
            if not reg.entries:
                return _error(404, "no prefill rank has registered yet")
            any_entry = next(iter(reg.entries.values()))
            return web.json_response({k: any_entry[k] for k in ("tp_size", "dp_size", *LAYOUT_KEYS)})
        entry = reg.entries.get((rank, dp))
        if entry is None:
            return _error(404, f"prefill rank {rank} of dp group {dp} has not registered yet")
        return web.json_response(entry)

    async def delete_route(request: web.Request) -> web.Response:
        if not reg.authorized(request):
            return _error(401, "missing or wrong cluster secret", "secret")
        reg.entries.pop(_ranks(request), None)
        return web.json_response({"ok": True})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "registered": len(reg.entries), "rejected": reg.rejected})

    app.router.add_put("/route", put_route)
    app.router.add_get("/route", get_route)
    app.router.add_delete("/route", delete_route)
    app.router.add_get("/health", health)
    return app


def run_bootstrap(host: str, port: int, secret: str | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [bootstrap] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    log.info("bootstrap server on http://%s:%d", host, port)
    web.run_app(make_app(secret), host=host, port=port, print=None)


def start_in_thread(host: str, port: int, secret: str | None) -> threading.Thread:
    """Embedded mode (the default for a prefill server): serve the registry on its own event loop."""
    ready = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(make_app(secret))
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, host, port).start())
        except BaseException as e:  # port in use, most likely
            failure.append(e)
            ready.set()
            return
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="bootstrap", daemon=True)
    thread.start()
    ready.wait(10)
    if failure:
        raise RuntimeError(f"embedded bootstrap server could not listen on {host}:{port}: {failure[0]}")
    return thread
