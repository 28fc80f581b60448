"""Relay a committed decode stream (SSE) to the client, watching the prefill half and both workers.

A stream always ends with either the decode's own `data: [DONE]` or one error event
`data: {"error": {...}}` followed by `data: [DONE]`; events are relayed whole, so an error event never
lands in the middle of a half-relayed one.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import aiohttp
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from common.wire.errors import error_body
from common.wire.sse import DONE, sse_event
from router.pair_call import PairCall
from router.upstream import DECODE_FAILED, UpstreamError, read_chunk

PREFILL_GRACE_S = 5.0  # after the decode's [DONE], how long the prefill's answer may still take


def sse_error(err: UpstreamError) -> bytes:
    return sse_event(err.body) + DONE


class SSEFramer:
    """Cuts a byte stream into whole SSE events and notices the closing [DONE]."""

    def __init__(self) -> None:
        self.pending = b""
        self.saw_done = False

    def feed(self, chunk: bytes) -> bytes:
        self.pending += chunk
        end = self.pending.rfind(b"\n\n") + 2
        if end < 2:
            return b""
        whole, self.pending = self.pending[:end], self.pending[end:]
        self.saw_done = whole.endswith(DONE)
        return whole


class PairStream:
    """The client's stream of one call. After it ends, `error` holds what ended it early, if anything,
    and `finished` says whether the client got its last byte (False: the client went away)."""

    def __init__(self, call: PairCall, resp: aiohttp.ClientResponse, first: bytes):
        self.call, self.resp, self.first = call, resp, first
        self.error: UpstreamError | None = None
        self.finished = False

    async def events(self) -> AsyncIterator[bytes]:
        try:
            async for whole in self._relay():
                yield whole
        except UpstreamError as e:
            self.error = e
            yield sse_error(e)
        self.finished = True

    async def _relay(self) -> AsyncIterator[bytes]:
        framer, chunk, decode = SSEFramer(), self.first, self.call.pair.decode
        while chunk and not framer.saw_done:
            if whole := framer.feed(chunk):
                yield whole
            if not framer.saw_done:
                chunk = await self.call.guarded(read_chunk(self.resp, decode))
        if not framer.saw_done:
            message = f"decode worker {decode.url} ended the stream without [DONE]"
            raise UpstreamError(502, error_body(message, "upstream_error", 502), DECODE_FAILED, decode)
        # the client has its answer; the prefill has almost surely answered too
        await asyncio.wait({self.call.prefill}, timeout=PREFILL_GRACE_S)


class PairStreamResponse(StreamingResponse):
    """Runs `on_close` once the response is over however it ended, also when the client left before the
    body started (an async generator that never started would never run its own `finally`)."""

    def __init__(self, stream: PairStream, on_close: Callable[[PairStream], None]):
        super().__init__(stream.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.stream, self.on_close = stream, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close(self.stream)
