"""One streamed request to an endpoint and what it measured: time to first token, the gaps between
tokens, end-to-end latency, and token counts (the server's usage when it reports one, else the stream's)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tandem.bench.endpoint import Endpoint
from tandem.bench.workload import BenchRequest

ERROR_CHARS = 300  # of a failed response's body, kept in the report


@dataclass
class RequestOutput:
    """Times in seconds from the moment the request was sent."""

    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int | None = None
    decode_cached_tokens: int | None = None  # a PD decode's own prefix-cache hit (not sent by the prefill)
    error: str = ""
    text: str = ""  # the answer
    output_ids: list[int] | None = None  # the answer's token ids, where the server sends them (/generate)
    turn: int | None = None  # a multi-turn conversation's turn, from 1


class StreamState:
    """Folds the events of one response into a RequestOutput."""

    def __init__(self, out: RequestOutput, backend: str, start: float):
        self.out, self.backend, self.start, self.last = out, backend, start, start
        self.events = 0  # events that brought tokens
        self.reported: int | None = None  # completion tokens as the server counts them

    def on_event(self, event: dict[str, Any], now: float) -> None:
        if "error" in event:
            error = event["error"]
            raise StreamError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        if not self._brings_tokens(event):
            return
        if self.events == 0:
            self.out.ttft = now - self.start
        else:
            self.out.itl.append(now - self.last)
        self.events += 1
        self.last = now

    def finish(self, now: float) -> RequestOutput:
        if self.events == 0:
            raise StreamError("the stream ended without a token")
        self.out.latency = now - self.start
        self.out.output_len = self.reported if self.reported is not None else self.events
        self.out.success = True
        return self.out

    def _brings_tokens(self, event: dict[str, Any]) -> bool:
        if self.backend == "sglang":  # cumulative output; meta_info counts its tokens
            meta = event.get("meta_info") or {}
            before = self.reported or 0
            self.out.text = event.get("text", self.out.text)
            if "output_ids" in event:
                self.out.output_ids = list(event["output_ids"])
            self._usage(meta.get("prompt_tokens"), meta.get("completion_tokens", before + 1), meta.get("cached_tokens"))
            self.out.decode_cached_tokens = meta.get("decode_cached_tokens", self.out.decode_cached_tokens)
            return self.reported > before
        usage = event.get("usage") or {}
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            self._usage(usage.get("prompt_tokens"), usage.get("completion_tokens"), details.get("cached_tokens"))
            self.out.decode_cached_tokens = details.get("decode_cached_tokens", self.out.decode_cached_tokens)
        if self.backend == "openai-chat":
            pieces = [(c.get("delta") or {}).get("content") or "" for c in event.get("choices") or []]
        else:
            pieces = [c.get("text") or "" for c in event.get("choices") or []]
        self.out.text += "".join(pieces)
        return any(pieces)

    def _usage(self, prompt: int | None, completion: int | None, cached: int | None) -> None:
        if prompt is not None:
            self.out.prompt_len = prompt
        if completion is not None:
            self.reported = completion
        if cached is not None:
            self.out.cached_tokens = cached


class StreamError(Exception):
    """The server reported an error inside the stream, or sent no token."""


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream, up to `data: [DONE]`."""
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def timed_request(session: aiohttp.ClientSession, endpoint: Endpoint, req: BenchRequest) -> RequestOutput:
    """Send `req` streaming and time it; failures come back as RequestOutput(success=False, error=...)."""
    out = RequestOutput(prompt_len=len(req.prompt_ids))
    start = time.perf_counter()
    state = StreamState(out, endpoint.backend, start)
    try:
        async with session.post(endpoint.url, json=endpoint.body(req)) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.text())[:ERROR_CHARS]}"
                return out
            async for event in sse_events(r):
                state.on_event(event, time.perf_counter())
        return state.finish(time.perf_counter())
    except StreamError as e:
        out.error = str(e)[:ERROR_CHARS]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # ValueError: a line that is not JSON
        out.error = f"{type(e).__name__}: {e}"[:ERROR_CHARS]
    return out
