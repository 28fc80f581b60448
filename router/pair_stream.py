"""Relay a committed decode stream (SSE) to the client, watching the prefill half and both workers.

Events are relayed whole, so an error event never lands in the middle of a half-relayed one. A stream ends
with the decode's own `data: [DONE]`, or early with `error` set: the dispatcher then moves the request to
another pair (router/migration.py, whose Moves also reads and strips the decode's token trace and turns its
error event into `error`) or ends the client's stream with one error event and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from common.wire.errors import error_body
from common.wire.sse import DONE
from router.http1 import Response
from router.logprobs import PromptLogprobs
from router.migration import Moves
from router.pair_call import PairCall
from router.upstream import DECODE_FAILED, UpstreamError, read_chunk

PREFILL_GRACE_S = 5.0  # after the decode's [DONE], how long the prefill's answer may still take


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
    """The events of one call's decode stream, from its first bytes on. After they end, `error` holds what
    ended them early, if anything. `moves`: the request's migration state, when the decode traces its tokens."""

    def __init__(
        self, call: PairCall, resp: Response, first: bytes, logprobs: PromptLogprobs | None, moves: Moves | None
    ):
        self.call, self.resp, self.first, self.logprobs, self.moves = call, resp, first, logprobs, moves
        self.error: UpstreamError | None = None

    async def events(self) -> AsyncIterator[bytes]:
        try:
            async for whole in self._relay():
                error = None
                if self.moves is not None:
                    whole, error = self.moves.observe(whole, self.call.pair.decode)
                if whole:
                    yield self.logprobs.events(whole) if self.logprobs else whole
                if error is not None:
                    raise error
        except UpstreamError as e:
            self.error = e

    async def _relay(self) -> AsyncIterator[bytes]:
        framer, chunk, decode = SSEFramer(), self.first, self.call.pair.decode
        while chunk and not framer.saw_done:
            if whole := framer.feed(chunk):
                yield whole
            if not framer.saw_done:
                chunk = await read_chunk(self.resp, decode)
        if not framer.saw_done:
            message = f"decode worker {decode.url} ended the stream without [DONE]"
            raise UpstreamError(502, error_body(message, "upstream_error", 502), DECODE_FAILED, decode)
        # the client has its answer; the prefill has almost surely answered too, and a finished answer
        # keeps its connection for the next request
        if not self.call.prefill_answer.done():
            await asyncio.wait({self.call.prefill_answer}, timeout=PREFILL_GRACE_S)
