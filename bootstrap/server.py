"""Bootstrap registry (aiohttp, SGLang-compatible routes): prefill ranks register their control
endpoint and KV layout; decode ranks look them up.

    PUT    /route                                   register (idempotent: a restart replaces)
    GET    /route?engine_rank=R&target_dp_group=G   one rank's entry; -1,-1: the parallel layout
    DELETE /route?engine_rank=R&target_dp_group=G   deregister
    GET    /health
    GET    /metrics                                 Prometheus: rejected requests, registered ranks

Every rejected request answers a JSON error naming the field at fault and is counted.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import re
import threading
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from common.wire.body import load_json_object
from common.wire.errors import InvalidRequest, error_body
from common.wire.kv_layout import LAYOUT_KEYS

log = logging.getLogger("tandem.bootstrap")

FIELDS: dict[str, tuple[type, ...]] = {
    "role": (str,), "tp_size": (int,), "tp_rank": (int,), "dp_size": (int,), "dp_rank": (int,),
    "rank_ip": (str,), "rank_port": (int,), "page_size": (int,), "num_layers": (int,), "kv_heads": (int,),
    "head_dim": (int,), "dtype": (str,), "transfer_backend": (str,), "instance_id": (str,),
}
DEFAULTS = {"dp_size": 1, "dp_rank": 0, "instance_id": ""}
SIZES = ("tp_size", "dp_size", "page_size", "num_layers", "kv_heads", "head_dim")
MAX_STRING = 255
MAX_BODY_BYTES = 64 * 1024
RANK_QUERY = re.compile(r"-?[0-9]{1,18}")  # a plain decimal: int() alone also takes " 1", "1_0", "١"
SECRET_HEADER = "X-Tandem-Secret"
STATUS_TYPES = {401: "authentication_error", 404: "not_found_error"}


class RegistrationError(ValueError):
    """A request the registry refuses; `field` names the part of it at fault."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.status = status


def validate_registration(body: Any) -> dict[str, Any]:
    """The registry entry of a PUT /route body, or RegistrationError naming the first bad field."""
    if not isinstance(body, dict):
        raise RegistrationError("body", "must be a JSON object")
    entry = DEFAULTS | {k: v for k, v in body.items() if k in FIELDS}
    for name, types in FIELDS.items():
        _check_type(name, entry.get(name), types)
    if entry["role"] != "Prefill":
        raise RegistrationError("role", "only 'Prefill' ranks register")
    if not 1 <= entry["rank_port"] <= 65535:
        raise RegistrationError("rank_port", "must be in 1..65535")
    for name in SIZES:
        if entry[name] < 1:
            raise RegistrationError(name, "must be >= 1")
    for rank, size in (("tp_rank", "tp_size"), ("dp_rank", "dp_size")):
        if not 0 <= entry[rank] < entry[size]:
            raise RegistrationError(rank, f"must be in 0..{size} - 1")
    if not entry["rank_ip"]:
        raise RegistrationError("rank_ip", "must be a host name or address")
    return entry


def _check_type(name: str, value: Any, types: tuple[type, ...]) -> None:
    if value is None:
        raise RegistrationError(name, "is required")
    if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
        raise RegistrationError(name, f"must be {types[0].__name__}")
    if isinstance(value, str) and len(value) > MAX_STRING:
        raise RegistrationError(name, f"must be at most {MAX_STRING} characters")


def parse_ranks(query: Any) -> tuple[int, int]:
    """(engine_rank, target_dp_group) of a GET/DELETE /route query; both default to 0."""
    ranks = []
    for name in ("engine_rank", "target_dp_group"):
        raw = query.get(name, "0")
        if not RANK_QUERY.fullmatch(raw):
            raise RegistrationError(name, "must be an integer")
        ranks.append(int(raw))
    if ranks != [-1, -1] and min(ranks) < 0:
        raise RegistrationError("engine_rank" if ranks[0] < 0 else "target_dp_group", "must be >= 0 (or both -1 for the layout)")
    return ranks[0], ranks[1]


class Registry:
    """The registered prefill ranks, the cluster secret and what was rejected (also as Prometheus metrics)."""

    def __init__(self, secret: str | None):
        self.secret = secret
        self.entries: dict[tuple[int, int], dict[str, Any]] = {}
        self.rejected = 0  # all rejected requests, read by an embedding prefill server's /metrics
        self.metrics = CollectorRegistry()
        self.rejected_registrations = Counter(
            "tandem_bootstrap_rejected_registrations", "PUT /route requests rejected, by the field at fault",
            ["field"], registry=self.metrics)
        self.rejected_lookups = Counter(
            "tandem_bootstrap_rejected_lookups", "GET and DELETE /route requests rejected, by method and field at fault",
            ["method", "field"], registry=self.metrics)
        Gauge("tandem_bootstrap_registered_ranks", "prefill ranks registered", registry=self.metrics).set_function(
            lambda: len(self.entries))

    def check_secret(self, request: web.Request, body: dict | None = None) -> None:
        """RegistrationError (401) unless the request carries the cluster secret (header, or `secret` in the body)."""
        if self.secret is None:
            return
        got = request.headers.get(SECRET_HEADER) or (body or {}).get("secret") or ""
        # surrogatepass: a JSON body may carry any code point, and comparing must not raise
        if not isinstance(got, str) or not hmac.compare_digest(got.encode("utf-8", "surrogatepass"), self.secret.encode()):
            raise RegistrationError("secret", f"missing or wrong cluster secret (send the {SECRET_HEADER} header)", 401)

    def reject(self, request: web.Request, e: RegistrationError) -> web.Response:
        self.rejected += 1
        if request.method == "PUT":
            self.rejected_registrations.labels(e.field).inc()
        else:
            self.rejected_lookups.labels(request.method, e.field).inc()
        log.info("rejected %s %s: %s", request.method, request.path, e)
        return _error(e.status, str(e), e.field)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return web.json_response(error_body(message, kind, status, param), status=status)


async def _read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RegistrationError("body", f"must be at most {MAX_BODY_BYTES} bytes", 413) from None
    try:
        return load_json_object(raw)
    except InvalidRequest as e:
        raise RegistrationError(e.param or "body", e.message) from None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(registry: Registry) -> web.Application:
    reg = registry
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors_as_json(reg)])

    async def put_route(request: web.Request) -> web.Response:
        body = await _read_json(request)
        reg.check_secret(request, body if isinstance(body, dict) else None)
        entry = validate_registration(body)
        key = (entry["tp_rank"], entry["dp_rank"])
        if reg.entries.get(key) != entry:  # prefills re-register every heartbeat: log only news
            log.info("registered prefill rank %s at %s:%s (%s)", entry["tp_rank"], entry["rank_ip"], entry["rank_port"], entry["instance_id"])
        reg.entries[key] = entry
        return web.json_response({"ok": True})

    async def get_route(request: web.Request) -> web.Response:
        reg.check_secret(request)
        rank, dp = parse_ranks(request.query)
        if (rank, dp) == (-1, -1):
            if not reg.entries:
                return _error(404, "no prefill rank has registered yet")
            any_entry = next(iter(reg.entries.values()))
            return web.json_response({k: any_entry[k] for k in ("tp_size", "dp_size", *LAYOUT_KEYS)})
        entry = reg.entries.get((rank, dp))
        if entry is None:  # not a rejection: decode polls while the prefill starts
            return _error(404, f"prefill rank {rank} of dp group {dp} has not registered yet")
        return web.json_response(entry)

    async def delete_route(request: web.Request) -> web.Response:
        reg.check_secret(request)
        reg.entries.pop(parse_ranks(request.query), None)
        return web.json_response({"ok": True})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "registered": len(reg.entries), "rejected": reg.rejected})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(reg.metrics), content_type="text/plain", charset="utf-8")

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
            return reg.reject(request, e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            param = {404: "path", 405: "method", 413: "body"}.get(e.status)
            return _error(e.status, f"{request.method} {request.path}: {e.reason}", param)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return _error(500, "internal error; the bootstrap log has the details")

    return middleware


def run_bootstrap(host: str, port: int, secret: str | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [bootstrap] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    log.info("bootstrap server on http://%s:%d", host, port)
    web.run_app(make_app(Registry(secret)), host=host, port=port, print=None)


def start_in_thread(host: str, port: int, secret: str | None) -> Registry:
    """Embedded mode (the default for a prefill server): serve the registry on its own thread and
    event loop. Returns the registry, whose `rejected` count the prefill reports in its /metrics."""
    registry = Registry(secret)
    ready = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(make_app(registry))
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, host, port).start())
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
