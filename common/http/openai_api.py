"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming)."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.config import ServerConfig
from common.core.request import GenInput
from common.edge.asgi import read_body, sse_response
from common.engine.engine import Engine
from common.http.adapters import model_adapter, model_cards, run_under, served
from common.http.batch import Part, build_parts, merged_streams
from common.http.chat_output import ChatShape
from common.http.openai_choices import chat_choice, completion_choice
from common.http.openai_stream import stream_answer
from common.http.reasoning import PARSERS as REASONING_PARSERS
from common.http.serving import (
    check_dp_rank,
    check_grammar,
    check_input,
    check_priority,
    collect,
    collect_all,
    created,
    new_rid,
    tokenize_text,
    usage,
)
from common.http.tool_parsers import PARSERS as TOOL_PARSERS
from common.wire.api import ChatCompletionRequest, CompletionRequest, OpenAIBase, parse_body, validate
from common.wire.batch import COMPLETIONS, split_batch, summed_usage
from common.wire.body import parse_json_object
from common.wire.errors import InvalidRequest, NotFound
from common.wire.sse import sse_event
from common.wire.structured_output import GrammarSpec


def add_routes(app: FastAPI, engine: Engine) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards(engine)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        """The SDK's models.retrieve: the base model or one of its LoRA adapters."""
        card = next((c for c in model_cards(engine) if c["id"] == model_id), None)
        if card is None:
            raise NotFound(f"model {model_id!r} does not exist; this server serves {served(engine)}", param="model")
        return card

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        data = parse_json_object(await read_body(request, engine.config.max_request_bytes))
        bodies = split_batch(COMPLETIONS, data)
        if bodies is not None:
            parts = await build_parts(engine, COMPLETIONS, data, bodies, functools.partial(_completion_input, engine))
            return await _respond_batch(engine, parts, request)
        (body, echo), gen = await _completion_input(engine, data)
        make_choice = functools.partial(completion_choice, echo=echo)
        return await _respond(engine, gen, body, "text_completion", make_choice, request, echo)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse_body(await read_body(request, engine.config.max_request_bytes), ChatCompletionRequest)
        return await chat_answer(engine, body, request)


async def chat_answer(engine: Engine, body: ChatCompletionRequest, request: Request) -> Response:
    """A chat completion's answer (JSON, or an SSE stream): /v1/chat/completions', and the Responses API's
    underneath (common/http/responses.py)."""
    adapter = model_adapter(engine, body.model)
    shape = _chat_shape(engine.config, body)
    ids = _apply_chat_template(engine.tokenizer, body, shape)
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, max_param)
    top = (body.top_logprobs or 0) if body.logprobs else None
    gen = _gen_input(engine, body, ids, max_tokens, "messages", max_param, top)
    run_under(engine, gen, adapter)
    gen.grammar_spec = _chat_constraint(body, shape)
    if shape.parser is not None and shape.parser.needs_special_tokens:  # its markers are special tokens
        gen.params = gen.params.model_copy(update={"skip_special_tokens": False})
    await check_grammar(engine.grammar, gen)
    make_choice = functools.partial(chat_choice, shape=shape)
    return await _respond(engine, gen, body, "chat.completion", make_choice, request, shape=shape)


async def _completion_input(
    engine: Engine, data: dict[str, Any]
) -> tuple[tuple[CompletionRequest, str | None], GenInput]:
    """((body, the prompt's text to echo or None), its GenInput), checked: one prompt of /v1/completions."""
    body = validate(data, CompletionRequest)
    adapter = model_adapter(engine, body.model)
    ids = body.prompt if isinstance(body.prompt, list) else tokenize_text(engine.tokenizer, body.prompt, "prompt")
    echo_logprobs = body.echo and body.logprobs is not None  # the prompt's logprobs are computed only then
    gen = _gen_input(engine, body, ids, body.max_tokens, "prompt", "max_tokens", body.logprobs, echo_logprobs)
    run_under(engine, gen, adapter)
    gen.grammar_spec = body.grammar_spec()
    await check_grammar(engine.grammar, gen)
    echo = (body.prompt if isinstance(body.prompt, str) else engine.tokenizer.decode(ids)) if body.echo else None
    return (body, echo), gen


async def _respond_batch(engine: Engine, parts: list[Part], request: Request) -> Response:
    """A batch's answer: its parts' choices in order (index prompt_i * n + j), usage summed; or one stream."""
    first_body, first = parts[0].built[0], parts[0].gen
    rid, model = "cmpl-" + first.rid, first.lora or engine.model_name
    if first_body.stream:
        streams = [stream_answer(engine, p.gen, p.built[0], "text_completion", rid, p.built[1], None, p) for p in parts]
        return sse_response(merged_streams(streams, functools.partial(_batch_usage_event, parts, rid, model)))
    for part, choices in zip(parts, await collect_all(engine, [p.gen for p in parts], request)):
        part.choices = choices
    answer = {"id": rid, "object": "text_completion", "created": created(), "model": model}
    choices = [
        completion_choice(engine.tokenizer, c, p.gen, p.built[1]) | {"index": p.offset + c.index}
        for p in parts
        for c in p.choices
    ]
    return JSONResponse(answer | {"choices": choices, "usage": _batch_usage(parts)})


def _batch_usage(parts: list[Part]) -> dict[str, Any]:
    return summed_usage([usage(p.choices, len(p.gen.prompt_ids)) for p in parts])


def _batch_usage_event(parts: list[Part], rid: str, model: str) -> bytes:
    """The last event of a batch's stream: the summed usage, when its client asked for usage."""
    options = parts[0].built[0].stream_options
    if not (options and options.include_usage):
        return b""
    base = {"id": rid, "object": "text_completion", "created": created(), "model": model}
    return sse_event(base | {"choices": [], "usage": _batch_usage(parts)})


def _chat_shape(c: ServerConfig, body: ChatCompletionRequest) -> ChatShape:
    """How the request's text becomes its message: its tools (checked), the server's parsers."""
    tools = body.tool_set()
    parser = TOOL_PARSERS[c.tool_call_parser] if tools.choice == "auto" and c.tool_call_parser else None
    return ChatShape(tools, parser, REASONING_PARSERS[c.reasoning_parser] if c.reasoning_parser else None)


def _chat_constraint(body: ChatCompletionRequest, shape: ChatShape) -> GrammarSpec | None:
    """The tool_choice's schema (required, named), else response_format / guided_*; after the thinking with a
    reasoning parser. Both may be given, as OpenAI takes them (the Agents SDK sends both for an agent with an
    output type): a forced call is constrained by its tool, the format applies to an answer in content."""
    spec = shape.tools.constraint() or body.grammar_spec()
    return spec.gated(True) if spec is not None and shape.reasoning is not None else spec


def _apply_chat_template(tokenizer: Any, body: ChatCompletionRequest, shape: ChatShape) -> list[int]:
    messages = [m.for_template() for m in body.messages]
    tools = shape.tools.template_tools()
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, **(body.chat_template_kwargs or {})
        )
    except Exception as e:  # jinja errors from the model's own template
        raise InvalidRequest(f"messages: the chat template rejected them: {e}", param="messages") from None
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _gen_input(
    engine: Engine,
    body: OpenAIBase,
    ids: list[int],
    max_tokens: int | None,
    param: str,
    max_param: str,
    top: int | None,
    prompt_logprobs: bool = False,
) -> GenInput:
    if max_tokens is None:
        max_tokens = max(engine.context_len - len(ids), 0)
    gen = GenInput(
        rid=body.migration.rid if body.migration else new_rid(),
        prompt_ids=ids,
        params=body.sampling_params(max_tokens, max_param),
        return_logprob=top is not None,
        top_logprobs_num=top or 0,
        rendezvous=body.rendezvous,
        pd_placement=body.pd_placement,
        logprob_start_len=0 if prompt_logprobs else -1,
        priority=check_priority(engine.config, body.priority),
        migration=body.migration,
        data_parallel_rank=check_dp_rank(engine.dp_size, body.data_parallel_rank),
    )
    check_input(engine, gen, param, max_param)
    return gen


async def _respond(
    engine: Engine,
    gen: GenInput,
    body: OpenAIBase,
    kind: str,
    make_choice,
    request: Request,
    echo: str | None = None,
    shape: ChatShape | None = None,
) -> Response:
    rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + gen.rid
    if body.stream:
        return sse_response(stream_answer(engine, gen, body, kind, rid, echo, shape))
    choices = await collect(engine, gen, request)
    return JSONResponse(
        {
            "id": rid,
            "object": kind,
            "created": created(gen),
            "model": gen.lora or engine.model_name,
            "choices": [make_choice(engine.tokenizer, c, gen) for c in choices],
            "usage": usage(choices, len(gen.prompt_ids)),
        }
    )
