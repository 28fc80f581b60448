"""The FastAPI app of every engine server (monolithic, prefill, decode): SGLang and OpenAI endpoints."""
from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from common import openai_api
from common.engine import Engine
from common.errors import InvalidRequest, TandemError, Unauthorized, error_body
from common.http_body import read_body
from common.protocol import GenerateRequest, parse_body
from common.serving import Choice, GenInput, check_input, collect, new_rid, raise_if_failed, stream_choices, tokenize_text

log = logging.getLogger("tandem.http")
OPEN_PATHS = {"/health", "/metrics"}
# What a Starlette routing error is about, for the `param` of its JSON error.
ROUTING_PARAMS = {404: "path", 405: "method"}


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="Tandem", version="0.1.0")
    app.state.engine = engine
    _install_middleware(app, engine)

    _install_error_handlers(app)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = parse_body(await read_body(request, engine.config.max_request_bytes), GenerateRequest)
        gen = generate_input(engine, body)
        if body.stream:
            return sse(generate_stream(engine, gen, body))
        choices = await collect(engine, gen, request)
        results = [generate_result(gen, c, body) for c in choices]
        return JSONResponse(results[0] if len(results) == 1 else results)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        gen = GenInput(new_rid("health-"), [engine.tokenizer.eos_token_id or 0], _one_token())
        await collect(engine, gen)
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        counts = (await engine.call(engine.scheduler.check_integrity)).to_dict()  # raises on a leak
        return {
            "config": engine.config.model_dump(exclude={"api_key", "cluster_secret"}),
            "model_path": str(engine.model_dir),
            "context_length": engine.context_len,
            "kv_pages": counts,
            "num_running_reqs": len(engine.scheduler.running),
            "num_waiting_reqs": len(engine.scheduler.waiting),
            "num_retractions": engine.scheduler.num_retractions,
            "role": engine.scheduler.role_info(),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    openai_api.add_routes(app, engine)
    return app


def _one_token():
    from common.sampling_params import SamplingParams

    return SamplingParams(max_new_tokens=1, temperature=0)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as the JSON error body, whoever raised it."""

    @app.exception_handler(TandemError)
    async def _tandem_error(_: Request, exc: TandemError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _routing_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        body = error_body(message, "invalid_request_error", exc.status_code, ROUTING_PARAMS.get(exc.status_code))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal error; the server log has the details", "internal_error", 500), status_code=500)


def _install_middleware(app: FastAPI, engine: Engine) -> None:
    # Pure ASGI, not @app.middleware("http"): Starlette's BaseHTTPMiddleware hides http.disconnect from
    # request.is_disconnected(), so a plain request whose client (the router) left was never aborted.
    app.add_middleware(_Guard, engine=engine)


class _Guard:
    """API key check, then per-endpoint counting and one log line for every error answer."""

    def __init__(self, app, engine: Engine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, path, status = time.monotonic(), scope["path"], 500

        async def send_noting_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            key = self.engine.config.api_key
            if key and path not in OPEN_PATHS:
                _check_api_key(Headers(scope=scope).get("authorization", ""), key)
            await self.app(scope, receive, send_noting_status)
        except TandemError as e:
            await JSONResponse(e.to_dict(), status_code=e.status, headers=e.headers)(scope, receive, send_noting_status)
        self._count(scope, path, status, start)

    def _count(self, scope, path: str, status: int, start: float) -> None:
        if _is_rejected_input(status):
            self.engine.metrics.count_rejection("http")
        if path not in OPEN_PATHS:
            endpoint = path if path in _route_paths(scope["app"]) else "other"  # bounded label values, whatever clients send
            self.engine.metrics.requests.labels(endpoint, str(status)).inc()
            if status >= 400:
                log.info("%s %s -> %d (%.1f ms)", scope["method"], path, status, 1000 * (time.monotonic() - start))


def _route_paths(app: FastAPI) -> set[str]:
    if not hasattr(app.state, "route_paths"):
        app.state.route_paths = {getattr(route, "path", "") for route in app.routes}
    return app.state.route_paths


def _is_rejected_input(status: int) -> bool:
    # 499 is no answer to bad input: the client left before the response was ready
    return 400 <= status < 500 and status != 499


def _check_api_key(header: str, key: str) -> None:
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
        raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer <key>'", param="authorization")


def generate_input(engine: Engine, body: GenerateRequest) -> GenInput:
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequest("give exactly one of text or input_ids", param="text")
    ids = body.input_ids if body.input_ids is not None else tokenize_text(engine, body.text, "text")
    gen = GenInput(
        rid=body.rid or new_rid(), prompt_ids=ids, params=body.sampling_params,
        return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
        logprob_start_len=body.logprob_start_len if body.return_logprob else -1, bootstrap=body.bootstrap,
    )
    check_input(engine, gen, "input_ids" if body.input_ids is not None else "text", "sampling_params.max_new_tokens")
    return gen


def generate_result(gen: GenInput, c: Choice, body: GenerateRequest) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": gen.rid if gen.params.n == 1 else f"{gen.rid}-{c.index}",
        "finish_reason": c.finish.to_dict() if c.finish else None,
        "prompt_tokens": len(gen.prompt_ids),
        "completion_tokens": len(c.output_ids),
        "cached_tokens": c.meta.get("cached_tokens", 0),
    }
    if body.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.output_ids)]
        if body.top_logprobs_num:
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top or []] for top in c.top_logprobs]
        if gen.logprob_start_len >= 0:
            lps = c.meta.get("input_token_logprobs") or [None] * len(gen.prompt_ids)
            start = gen.logprob_start_len
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps[start:], gen.prompt_ids[start:])]
    return {"text": c.text, "output_ids": c.output_ids, "meta_info": meta}


async def generate_stream(engine: Engine, gen: GenInput, body: GenerateRequest) -> AsyncIterator[bytes]:
    choices = [Choice(i) for i in range(gen.params.n)]
    try:
        async for i, ev in stream_choices(engine, gen):
            choices[i].add(ev)
            raise_if_failed(ev.finish)
            yield sse_event(generate_result(gen, choices[i], body) | {"index": i})
    except TandemError as e:
        yield sse_event(e.to_dict())
    yield b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse(stream: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


__all__ = ["create_app", "error_body", "sse", "sse_event"]
