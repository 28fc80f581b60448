"""The SSE stream of a completion or a chat completion: chunks as the engine's events come.

One event of choice i becomes one chunk (a completion: its text piece, the prompt first when echoed) or a
few (a chat: the deltas its ChoiceStream releases: reasoning, content, tool calls; the finish reason on a
last one). In front of each chunk goes the tracer's line for the router (common/http/serving.py's Tracer:
the tokens it carries, whether the choice ended). A migrated request's choices go on where its client's
stream left them: no role event or echo again, and each ChoiceStream fed first what the earlier server had
fed it (common/wire/migration.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from common.core.request import GenInput
from common.engine.engine import Engine
from common.engine.output import replayed_text
from common.http.batch import Part
from common.http.chat_output import ChatShape, ChoiceStream
from common.http.openai_choices import FINISH, chat_logprobs, completion_choice
from common.http.serving import Choice, Tracer, created, initial_choices, raise_if_failed, stream_choices, usage
from common.wire.api import OpenAIBase
from common.wire.errors import TandemError
from common.wire.sse import DONE, sse_event


@dataclass
class _Stream:
    """One answer's stream state: its chunks' common fields, its choices, what each still echoes, each chat
    choice's ChoiceStream, the router's tracer and the index its choices are numbered from."""

    engine: Engine
    gen: GenInput
    base: dict[str, Any]
    choices: list[Choice]
    to_echo: list[str | None]
    streams: list[ChoiceStream]
    tracer: Tracer
    offset: int


async def stream_answer(
    engine: Engine,
    gen: GenInput,
    body: OpenAIBase,
    kind: str,
    rid: str,
    echo: str | None,
    shape: ChatShape | None,
    part: Part | None = None,
) -> AsyncIterator[bytes]:
    """The answer's events (the module docstring). A batch's `part`: its choices numbered from its offset, no
    usage or [DONE] (its batch's stream ends)."""
    s = _start(engine, gen, kind, rid, echo, shape, part)
    for line in _role_events(s) if shape is not None else ():
        yield line
    try:
        async for i, ev in stream_choices(engine, gen):
            s.choices[i].add(ev)
            raise_if_failed(ev.finish)
            for line in _event_lines(s, i, ev):
                yield line
        if part is None and body.stream_options and body.stream_options.include_usage:
            yield sse_event(s.base | {"choices": [], "usage": usage(s.choices, len(gen.prompt_ids))})
    except TandemError as e:
        yield sse_event(e.to_dict())
    if part is None:
        yield DONE


def _start(engine, gen, kind, rid, echo, shape, part) -> _Stream:
    """The stream's state, each chat choice's ChoiceStream fed what a migrated request's client was shown."""
    chunk_kind = kind + ".chunk" if kind == "chat.completion" else kind
    base = {"id": rid, "object": chunk_kind, "created": created(gen), "model": gen.lora or engine.model_name}
    choices, tracer = initial_choices(gen), Tracer(gen)
    if part is not None:
        part.choices = choices
    to_echo = [None if tracer.seen(i) else echo for i in range(gen.params.n)]
    streams = [ChoiceStream(shape) for _ in choices] if shape is not None else []
    for i, shown in enumerate(gen.migration.resume or () if gen.migration else ()):
        for piece in replayed_text(engine.tokenizer, gen.params, shown.output_ids) if streams and shown else ():
            streams[i].feed(piece)  # as the earlier server fed it: what it sent, what it held back
    return _Stream(engine, gen, base, choices, to_echo, streams, tracer, 0 if part is None else part.offset)


def _role_events(s: _Stream) -> list[bytes]:
    """A chat's first event per choice (the assistant's role), except for choices a migration resumes."""
    role = {"role": "assistant", "content": ""}
    choice = lambda i: {"index": i, "delta": role, "logprobs": None, "finish_reason": None}  # noqa: E731
    return [
        s.tracer.line(c.index) + sse_event(s.base | {"choices": [choice(c.index)]})
        for c in s.choices
        if not s.tracer.seen(c.index)
    ]


def _event_lines(s: _Stream, i: int, ev) -> list[bytes]:
    """One engine event of choice i as the lines it sends: its chunks, the tracer's line before the first
    (or alone, when every delta is held back: the tokens still go to the router)."""
    if not ev.text and ev.finish is None and not s.gen.return_logprob and s.to_echo[i] is None:
        return [s.tracer.alone(i, ev)] if s.tracer.on else []
    chunks = _chunks(s, i, ev)
    finished = ev.finish is not None
    line, lines = s.tracer.line(i, ev.token_ids, finished and len(chunks) <= 1), []
    for k, choice in enumerate(chunks):
        if finished and k == len(chunks) - 1 and k > 0:  # the choice ended once its last chunk is out
            line = s.tracer.line(i, [], True)
        lines.append(line + sse_event(s.base | {"choices": [choice]}))
        line = b""
    return lines + ([line + b"\n"] if line else [])


def _chunks(s: _Stream, i: int, ev) -> list[dict[str, Any]]:
    """The choices of one event's chunks: a chat's deltas, or a completion's piece (echo first, once)."""
    finish = FINISH.get(ev.finish.type) if ev.finish else None
    c = s.choices[i]
    piece = Choice(s.offset + i, ev.text, ev.token_ids, ev.logprobs, ev.top_logprobs, meta=c.meta)
    if s.streams:
        lp = {"content": chat_logprobs(s.engine.tokenizer, piece)} if s.gen.return_logprob else None
        return chat_chunks(s.streams[i], ev.text, ev.finish is not None, finish, lp, i)
    echo, s.to_echo[i] = s.to_echo[i], None
    return [completion_choice(s.engine.tokenizer, piece, s.gen, echo) | {"finish_reason": finish}]


def chat_chunks(
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
