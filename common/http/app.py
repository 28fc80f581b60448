"""The FastAPI app of every engine server (monolithic, prefill, decode): SGLang and OpenAI endpoints."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from common.core.request import GenInput
from common.edge.asgi import ApiKeyGuard, DrainGuard, read_body, sse_response
from common.engine.engine import Engine
from common.http import openai_api
from common.http.adapters import named_adapter, run_under
from common.http.batch import Part, build_parts, merged_streams
from common.http.guard import CountingGuard
from common.http.info_api import add_info_routes
from common.http.lora_admin import add_lora_routes
from common.http.responses import add_responses_api
from common.http.role_guard import RoleGuard, role_headers
from common.http.serving import (
    PD_CACHED,
    SPEC_COUNTS,
    Choice,
    Tracer,
    check_dp_rank,
    check_grammar,
    check_input,
    check_priority,
    collect,
    collect_all,
    initial_choices,
    new_rid,
    raise_if_failed,
    stream_choices,
    tokenize_text,
)
from common.http.switch_guard import SwitchGuard, add_role_switch_route
from common.wire.api import GenerateRequest, validate
from common.wire.batch import GENERATE, split_batch
from common.wire.body import parse_json_object
from common.wire.drain import Drain
from common.wire.errors import InvalidRequest, TandemError, error_body
from common.wire.sse import DONE, sse_event

log = logging.getLogger("tandem.http")
# without the API key: probes (a kubelet's carry no key; SGLang leaves /health* open too) and Prometheus
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
# What a Starlette routing error is about, for the `param` of its JSON error.
ROUTING_PARAMS = {404: "path", 405: "method"}


def create_app(engine: Engine, drain: Drain | None = None) -> FastAPI:
    """`drain`: the server's graceful stop (common/http/drain.py); None in tests that never stop it."""
    app = FastAPI(title="Tandem", version="0.1.0")
    app.state.engine = engine
    # outermost last: the counting guard sees the API key guard's 401s and the drain's 503s too
    if engine.config.disaggregation_mode != "null":
        app.add_middleware(RoleGuard, engine=engine)
    if engine.role_switch is not None:
        app.add_middleware(SwitchGuard, switch=engine.role_switch)
    if drain is not None:
        app.add_middleware(DrainGuard, drain=drain)
    app.add_middleware(ApiKeyGuard, api_key=engine.config.api_key, open_paths=OPEN_PATHS)
    app.add_middleware(CountingGuard, metrics=engine.metrics, open_paths=OPEN_PATHS)
    _install_error_handlers(app)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        data = parse_json_object(await read_body(request, engine.config.max_request_bytes))
        bodies = split_batch(GENERATE, data)
        if bodies is not None:
            parts = await build_parts(engine, GENERATE, data, bodies, functools.partial(_generate_part, engine))
            return await generate_batch(engine, parts, request)
        body, gen = await _generate_part(engine, data)
        if body.stream:
            return sse_response(generate_stream(engine, gen, body))
        choices = await collect(engine, gen, request)
        results = [generate_result(gen, c, body) for c in choices]
        return JSONResponse(results[0] if len(results) == 1 else results)

    @app.get("/health")
    async def health() -> Response:
        """Liveness for routers and probes: 503 naming the cause when the scheduler cannot serve.
        The headers name this server's transfer instance and role (PD roles), which routers follow."""
        headers = role_headers(engine)
        problem = engine.health_problem()
        if problem is not None:
            return JSONResponse(error_body(problem, "unhealthy", 503), status_code=503, headers=headers)
        return Response(status_code=200, headers=headers)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if engine.config.disaggregation_mode != "null":
            # a prefill or decode cannot generate without its peer: its scheduler loop answering is the check
            await asyncio.wrap_future(engine.run_on_scheduler(lambda: None))
            return Response(status_code=200)
        gen = GenInput(new_rid("health-"), [engine.tokenizer.eos_token_id or 0], _one_token())
        await collect(engine, gen)
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return await asyncio.wrap_future(engine.run_on_scheduler(engine.server_info))  # raises on a leak

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    openai_api.add_routes(app, engine)
    add_responses_api(app, engine)
    add_lora_routes(app, engine)
    add_info_routes(app, engine)
    add_role_switch_route(app, engine)
    return app


def _one_token():
    from common.wire.sampling_params import SamplingParams

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
        return JSONResponse(
            error_body("internal error; the server log has the details", "internal_error", 500), status_code=500
        )


async def _generate_part(engine: Engine, data: dict[str, Any]) -> tuple[GenerateRequest, GenInput]:
    """One prompt of /generate: its body and GenInput, checked (its grammar compiled)."""
    body = validate(data, GenerateRequest)
    gen = generate_input(engine, body)
    gen.grammar_spec = body.grammar_spec()
    await check_grammar(engine.grammar, gen)
    return body, gen


async def generate_batch(engine: Engine, parts: list[Part], request: Request) -> Response:
    """A batch's answer: a list of every prompt's choices, prompt by prompt; or one stream whose events carry
    index prompt_i * n + j (SGLang's)."""
    if parts[0].built.stream:
        streams = [generate_stream(engine, p.gen, p.built, p) for p in parts]
        return sse_response(merged_streams(streams, lambda: b""))
    answers = await collect_all(engine, [p.gen for p in parts], request)
    return JSONResponse([generate_result(p.gen, c, p.built) for p, choices in zip(parts, answers) for c in choices])


def generate_input(engine: Engine, body: GenerateRequest) -> GenInput:
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequest("give exactly one of text or input_ids", param="text")
    ids = body.input_ids if body.input_ids is not None else tokenize_text(engine.tokenizer, body.text, "text")
    gen = GenInput(
        rid=body.rid or (body.migration.rid if body.migration else new_rid()),
        prompt_ids=ids,
        params=body.sampling_params,
        return_logprob=body.return_logprob,
        top_logprobs_num=body.top_logprobs_num,
        logprob_start_len=body.logprob_start_len if body.return_logprob else -1,
        rendezvous=body.rendezvous,
        pd_placement=body.pd_placement,
        priority=check_priority(engine.config, body.priority),
        migration=body.migration,
        data_parallel_rank=check_dp_rank(engine.dp_size, body.data_parallel_rank),
    )
    check_input(engine, gen, "input_ids" if body.input_ids is not None else "text", "sampling_params.max_new_tokens")
    run_under(engine, gen, named_adapter(engine, body.lora_path))
    return gen


def generate_result(gen: GenInput, c: Choice, body: GenerateRequest) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": gen.rid if gen.params.n == 1 else f"{gen.rid}-{c.index}",
        "finish_reason": c.finish.to_dict() if c.finish else None,
        "prompt_tokens": len(gen.prompt_ids),
        "completion_tokens": len(c.output_ids),
        "cached_tokens": c.meta.get("cached_tokens", 0),
    } | {k: c.meta[k] for k in (*PD_CACHED, *SPEC_COUNTS, "dp_rank") if k in c.meta}
    if body.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.output_ids)]
        if body.top_logprobs_num:
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top or []] for top in c.top_logprobs]
        if gen.logprob_start_len >= 0:
            n, start = len(gen.prompt_ids), gen.logprob_start_len
            lps = c.meta.get("input_token_logprobs") or [None] * n
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps[start:], gen.prompt_ids[start:])]
            if body.top_logprobs_num:
                tops = c.meta.get("input_top_logprobs") or [None] * n
                meta["input_top_logprobs"] = [
                    None if top is None else [[lp, t, None] for t, lp in top] for top in tops[start:]
                ]
    return {"text": c.text, "output_ids": c.output_ids, "meta_info": meta}


async def generate_stream(
    engine: Engine, gen: GenInput, body: GenerateRequest, part: Part | None = None
) -> AsyncIterator[bytes]:
    """SGLang's streamed /generate: every event holds its choice's whole output so far (a migrated request's
    from what its client was shown on earlier servers on: common/wire/migration.py). A batch's `part`: indexes
    from its offset, no [DONE] (its batch's stream ends)."""
    choices, tracer = initial_choices(gen), Tracer(gen)
    offset = 0 if part is None else part.offset
    try:
        async for i, ev in stream_choices(engine, gen):
            choices[i].add(ev)
            raise_if_failed(ev.finish)
            line = tracer.line(i, ev.token_ids, ev.finish is not None)
            yield line + sse_event(generate_result(gen, choices[i], body) | {"index": offset + i})
    except TandemError as e:
        yield sse_event(e.to_dict())
    if part is None:
        yield DONE
