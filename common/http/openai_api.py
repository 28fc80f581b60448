"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.config import ServerConfig
from common.core.request import GenInput
from common.edge.asgi import read_body, sse_response
from common.engine.engine import Engine
from common.engine.output import replayed_text
from common.http.adapters import model_adapter, model_cards, run_under, served
from common.http.batch import Part, build_parts, merged_streams
from common.http.chat_output import ChatShape, ChoiceStream
from common.http.reasoning import PARSERS as REASONING_PARSERS
from common.http.serving import (
    Choice,
    Tracer,
    check_dp_rank,
    check_grammar,
    check_input,
    check_priority,
    collect,
    collect_all,
    created,
    initial_choices,
    new_rid,
    raise_if_failed,
    stream_choices,
    tokenize_text,
    usage,
)
from common.http.tool_parsers import PARSERS as TOOL_PARSERS
from common.wire.api import ChatCompletionRequest, CompletionRequest, OpenAIBase, parse_body, validate
from common.wire.batch import COMPLETIONS, split_batch, summed_usage
from common.wire.body import parse_json_object
from common.wire.errors import InvalidRequest, NotFound, TandemError
from common.wire.sse import DONE, sse_event
from common.wire.structured_output import GrammarSpec

FINISH = {"stop": "stop", "length": "length"}


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
        make_choice = functools.partial(_completion_choice, echo=echo)
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
    make_choice = functools.partial(_chat_choice, shape=shape)
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
        streams = [_stream(engine, p.gen, p.built[0], "text_completion", rid, p.built[1], None, p) for p in parts]
        return sse_response(merged_streams(streams, functools.partial(_batch_usage_event, parts, rid, model)))
    for part, choices in zip(parts, await collect_all(engine, [p.gen for p in parts], request)):
        part.choices = choices
    answer = {"id": rid, "object": "text_completion", "created": created(), "model": model}
    choices = [
        _completion_choice(engine.tokenizer, c, p.gen, p.built[1]) | {"index": p.offset + c.index}
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


def _chat_chunks(
    stream: ChoiceStream, text: str, ended: bool, finish: str | None, logprobs: Any, index: int
) -> list[dict[str, Any]]:
    """The chunks of one event: its deltas (reasoning, content, tool calls), the logprobs on the first, and
    the finish reason on a last one with an empty delta (OpenAI's)."""
    deltas = stream.feed(text)
    if ended:
        more, finish = stream.end(finish)
        deltas += more
    chunks = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    if not chunks and (logprobs is not None or ended) or ended and "tool_calls" in chunks[-1]["delta"]:
        chunks.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": None})
    if logprobs is not None:
        chunks[0]["logprobs"] = logprobs
    if ended:
        chunks[-1]["finish_reason"] = finish
    return chunks


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
        return sse_response(_stream(engine, gen, body, kind, rid, echo, shape))
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


def _completion_choice(tokenizer: Any, c: Choice, gen: GenInput, echo: str | None = None) -> dict[str, Any]:
    """With `echo` (the prompt's text), the prompt comes first: in the text and, token by token, in the logprobs."""
    logprobs = (
        _completion_logprobs(tokenizer, c, gen.prompt_ids if echo is not None else None) if gen.return_logprob else None
    )
    return {
        "index": c.index,
        "text": (echo or "") + c.text,
        "logprobs": logprobs,
        "finish_reason": FINISH.get(c.finish.type) if c.finish else None,
    }


def _chat_choice(tokenizer: Any, c: Choice, gen: GenInput, shape: ChatShape) -> dict[str, Any]:
    message, finish = shape.message(c.text, FINISH.get(c.finish.type) if c.finish else None)
    return {
        "index": c.index,
        "message": message,
        "logprobs": {"content": _chat_logprobs(tokenizer, c)} if gen.return_logprob else None,
        "finish_reason": finish,
    }


def _token_str(tokenizer: Any, token: int) -> str:
    return tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token)])


def _completion_logprobs(tokenizer: Any, c: Choice, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """OpenAI's logprobs of the choice's tokens, preceded by the prompt's when `prompt_ids` are given (the
    first prompt token has no logprob and no top logprobs: nothing predicted it)."""
    top_dict = lambda top: {_token_str(tokenizer, t): lp for t, lp in top or []}  # noqa: E731
    token_ids, token_logprobs, tops = c.output_ids, list(c.logprobs), [top_dict(top) for top in c.top_logprobs]
    if prompt_ids is not None:
        n = len(prompt_ids)
        token_ids = prompt_ids + token_ids
        token_logprobs = (c.meta.get("input_token_logprobs") or [None] * n) + token_logprobs
        prompt_tops = c.meta.get("input_top_logprobs") or [None] * n
        tops = [None] + [top_dict(top) for top in prompt_tops[1:]] + tops
    tokens = [_token_str(tokenizer, t) for t in token_ids]
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else [],
    }


def _chat_logprobs(tokenizer: Any, c: Choice) -> list[dict[str, Any]]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        s = _token_str(tokenizer, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return [
        entry(t, lp) | {"top_logprobs": [entry(tt, tlp) for tt, tlp in top or []]}
        for t, lp, top in zip(c.output_ids, c.logprobs, c.top_logprobs)
    ]


async def _stream(
    engine: Engine,
    gen: GenInput,
    body: OpenAIBase,
    kind: str,
    rid: str,
    echo: str | None,
    shape: ChatShape | None,
    part: Part | None = None,
) -> AsyncIterator[bytes]:
    """Chunks as they come; with `echo`, each choice's first chunk starts with the prompt. A migrated request's
    choices go on where its client's stream left them (no role event or echo again: common/wire/migration.py).
    A batch's `part`: its choices numbered from its offset, no usage or [DONE] (its batch's stream ends)."""
    chunk_kind = kind + ".chunk" if kind == "chat.completion" else kind
    base = {"id": rid, "object": chunk_kind, "created": created(gen), "model": gen.lora or engine.model_name}
    choices = initial_choices(gen)
    offset = 0 if part is None else part.offset
    if part is not None:
        part.choices = choices
    is_chat = kind == "chat.completion"
    tracer = Tracer(gen)
    to_echo = [None if tracer.seen(i) else echo for i in range(gen.params.n)]
    streams = [ChoiceStream(shape) for _ in choices] if shape is not None else []
    for i, shown in enumerate(gen.migration.resume or () if gen.migration else ()):
        for piece in replayed_text(engine.tokenizer, gen.params, shown.output_ids) if streams and shown else ():
            streams[i].feed(piece)  # as the earlier server fed it: what it sent, what it held back
    if is_chat:
        for c in choices:
            if tracer.seen(c.index):
                continue
            role = {"role": "assistant", "content": ""}
            choice = {"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}
            yield tracer.line(c.index) + sse_event(base | {"choices": [choice]})
    try:
        async for i, ev in stream_choices(engine, gen):
            c = choices[i]
            c.add(ev)
            raise_if_failed(ev.finish)
            if not ev.text and ev.finish is None and not gen.return_logprob and to_echo[i] is None:
                if tracer.on:
                    yield tracer.alone(i, ev)
                continue
            finish = FINISH.get(ev.finish.type) if ev.finish else None
            piece = Choice(offset + i, ev.text, ev.token_ids, ev.logprobs, ev.top_logprobs, meta=c.meta)
            if is_chat:
                lp = {"content": _chat_logprobs(engine.tokenizer, piece)} if gen.return_logprob else None
                chunks = _chat_chunks(streams[i], ev.text, ev.finish is not None, finish, lp, i)
            else:
                chunks = [_completion_choice(engine.tokenizer, piece, gen, to_echo[i]) | {"finish_reason": finish}]
                to_echo[i] = None
            finished = ev.finish is not None
            line = tracer.line(i, ev.token_ids, finished and len(chunks) <= 1)
            for k, choice in enumerate(chunks):
                if finished and k == len(chunks) - 1 and k > 0:  # the choice ended once its last chunk is out
                    line = tracer.line(i, [], True)
                yield line + sse_event(base | {"choices": [choice]})
                line = b""
            if line:  # every delta held back (a possible tool call): the tokens still go to the router
                yield line + b"\n"
        if part is None and body.stream_options and body.stream_options.include_usage:
            yield sse_event(base | {"choices": [], "usage": usage(choices, len(gen.prompt_ids))})
    except TandemError as e:
        yield sse_event(e.to_dict())
    if part is None:
        yield DONE
