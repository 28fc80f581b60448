"""Serving one generation request: admission, the body, a (prefill, decode) pair, one retry on another
pair when a worker refused before anything reached the client (and one after each refusal of the role the router
meant a half for: the worker's role was switched, the router follows it), moves to another pair when a pair fails
(router/migration.py), and the reply (plain or streamed).

The body is parsed once (to check it and read the few fields the router needs) and forwarded as the
client's own bytes with the bootstrap fields appended: JSON parsers keep the last of duplicate keys.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from common.wire.batch import split_batch, stream_refused
from common.wire.body import parse_json_object, read_limited
from common.wire.errors import TandemError, error_body
from common.wire.sse import DONE, sse_event
from router.adapters import missing_adapter
from router.admission import Admission
from router.batch import dispatch_batch
from router.config import RouterConfig
from router.http1 import Pools
from router.logprobs import PromptLogprobs, wants_prompt_logprobs
from router.metrics import RouterMetrics
from router.migration import Moves
from router.pair_call import Pair, PairCall, pair_fields
from router.pair_stream import PREFILL_GRACE_S, PairStream
from router.placement.placer import Placer
from router.request_hints import NONE, RequestHints
from router.upstream import CLIENT_DISCONNECTED, UpstreamError, read_all, read_chunk
from router.workers import WorkerRegistry

log = logging.getLogger("tandem.router")
COMPACT = json.JSONEncoder(separators=(",", ":"))  # json.dumps builds an encoder per call when given separators
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
CHAT = "/v1/chat/completions"


def json_response(body: dict | bytes, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return web.Response(body=data, status=status, headers=headers, content_type="application/json")


def forward_bodies(raw: bytes, body: dict[str, Any], forwarded: dict[str, Any]) -> tuple[bytes, bytes]:
    """(prefill body, decode body) for `forwarded`, the client's `body` as the workers get it: the client's own
    bytes `raw` with the fields `forwarded` adds or changes appended (encoded anew only when one of the
    client's fields must go). The prefill's does not stream."""
    if any(k not in forwarded for k in body):
        decode = COMPACT.encode(forwarded).encode()
    else:
        extra = {k: v for k, v in forwarded.items() if k not in body or body[k] is not v}
        decode = (
            raw[: raw.rindex(b"}")] + (b"," if body else b"") + COMPACT.encode(extra).encode()[1:] if extra else raw
        )
    return (decode[: decode.rindex(b"}")] + b',"stream":false}' if body.get("stream") else decode), decode


@dataclass
class Reply:
    """The client's side of one request: its stream once a try started it, and the prompt's logprobs once
    read (a moved stream keeps both)."""

    path: str
    request: web.Request
    start: float
    out: web.StreamResponse | None = None
    logprobs: PromptLogprobs | None = None
    relay: Relay | None = None  # what the client's stream is made of the decode's (the Responses API's events)


class Relay(Protocol):
    """Turns a decode stream's whole events into the client's (common/wire/responses_stream.py's SSETranslator);
    once `ended`, the stream ends there (a cancelled response), closing the call."""

    ended: bool

    def feed(self, data: bytes) -> bytes: ...


class Dispatcher:
    """Routes generation requests (`handle` is the aiohttp handler of every generation path)."""

    def __init__(
        self,
        config: RouterConfig,
        workers: WorkerRegistry,
        metrics: RouterMetrics,
        admission: Admission,
        pools: Pools,
        placer: Placer,
    ):
        """`placer`: picks each try's pair (router/placement/placer.py)."""
        self.config, self.workers, self.metrics, self.admission = config, workers, metrics, admission
        self.placer = placer
        self.pools = pools  # each worker's keep-alive connections
        self.counters: dict[tuple[str, int], Any] = {}  # (path, status) -> its requests counter

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The body is read (within its deadline) before the request takes an admission slot, so clients
        that send slowly cannot hold the slots."""
        path, start = request.path, time.monotonic()
        try:
            raw = await read_limited(request.headers, request.content.iter_any(), self.config.max_request_bytes)
            body = parse_json_object(raw)
            hints = RequestHints.from_headers(request.headers)
            parts = split_batch(path, body)
            if parts is not None and body.get("stream"):
                raise stream_refused(path)
        except TandemError as e:
            return self._reply(path, json_response(e.to_dict(), e.status, e.headers), None, start)
        if parts is not None:
            return await dispatch_batch(self, path, request, body, parts, start, hints)
        return await self.dispatch(path, request, raw, body, start, hints)

    async def dispatch(
        self,
        path: str,
        request: web.Request,
        raw: bytes,
        body: dict[str, Any],
        start: float,
        hints: RequestHints = NONE,
        relay: Relay | None = None,
    ) -> web.StreamResponse:
        """A request read and parsed (`raw` its bytes, `body` its JSON, `hints` its placement headers) through a
        pair, once admitted (429 if not); a stream's events through `relay`, if given."""
        if not self.admission.try_enter():
            limit = self.admission.limit
            error = error_body(
                f"the router has {limit} requests in flight, its limit; retry later", "overloaded_error", 429
            )
            return self._reply(path, json_response(error, 429, {"Retry-After": "1"}), None, start)
        try:
            return await self._handle_admitted(Reply(path, request, start, relay=relay), raw, body, hints)
        finally:
            self.admission.leave()

    async def _handle_admitted(
        self, reply: Reply, raw: bytes, body: dict[str, Any], hints: RequestHints
    ) -> web.StreamResponse:
        """Tries on pairs until one answers: once more after a worker refused before anything was sent, and again
        after each refusal of the role a worker was meant for (retries: _retries), and up to --migration-limit more
        after a pair failed (a move: router/migration.py)."""
        path, moves = reply.path, Moves(self.config, reply.path, body)
        missing = missing_adapter(body, list(self.workers.workers.values()))
        if missing is not None:
            return self._reply(path, json_response(missing.to_dict(), missing.status), None, reply.start)
        extra = self._slo_fields(body, hints)
        retried = False
        while True:
            pair = self.placer.pick(body, moves.exclude, hints)
            if pair is None and moves.done:  # what a move avoids may have been the pair's fault, not a worker's
                pair = self.placer.pick(body, moves.lost, hints)
            if pair is None:
                return await self._give_up(reply, moves.error, None)
            moves.handover = len(self.workers.healthy("decode")) > 1
            try:
                return await self._serve_on(pair, reply, raw, body, moves, extra)
            except UpstreamError as e:
                moves.error = e
                if self._retries(e, moves, retried):
                    retried = retried or e.role_headers is None
                    continue
                reason = moves.again(e, pair.prefill, pair.decode)
                if reason is None:
                    return await self._give_up(reply, e, pair)
                log.info("moving %s to another pair (%s, move %d): %s", path, reason, moves.done, e)
                self.metrics.migrations.labels(reason).inc()

    def _retries(self, e: UpstreamError, moves: Moves, retried: bool) -> bool:
        """Whether `e` is retried on another pair now, its worker avoided from then on: a refusal of the role the
        worker was meant for (its role was switched; the router follows it here) always, as each changes the
        registry; another refusal before anything reached the client or the worker, once."""
        role_refused = e.role_headers is not None
        if role_refused:
            self.workers.follow(e.worker, e.role_headers.get)
        elif retried or not e.retriable or moves.shown_any or e.worker is None:
            return False
        log.info("retrying on another pair: %s", e)
        moves.exclude.add(e.worker.url)
        self.metrics.retries.inc()
        return True

    def _slo_fields(self, body: dict[str, Any], hints: RequestHints) -> dict[str, Any]:
        """With --slo-priority, a request's priority from its TTFT target, unless it has one."""
        priority = hints.priority() if self.config.slo_priority and body.get("priority") is None else None
        return {"priority": priority} if priority is not None else {}

    async def _give_up(self, reply: Reply, error: UpstreamError | None, pair: Pair | None) -> web.StreamResponse:
        """The request's end when no pair serves it: `error` (the last failure) or 503 when no pair was left,
        as the answer, or as the last event of the client's stream once that started."""
        if error is not None:
            body, status, headers, outcome = error.body, error.status, error.headers, f"{error.cause}: {error}"
        else:
            msg = "no healthy prefill and decode worker pair is available; retry later"
            body, status, headers, outcome = error_body(msg, "overloaded_error", 503), 503, {"Retry-After": "1"}, ""
        if reply.out is None:
            return self._reply(reply.path, json_response(body, status, headers), pair, reply.start, outcome)
        try:
            data = sse_event(body) + DONE
            await reply.out.write(reply.relay.feed(data) if reply.relay else data)
            await reply.out.write_eof()
        except ConnectionError:
            pass  # the client went away too
        self._record(reply.path, 200, pair, reply.start, f"stream ended with an error event: {outcome}")
        return reply.out

    async def _serve_on(
        self, pair: Pair, reply: Reply, raw: bytes, body: dict[str, Any], moves: Moves, extra: dict[str, Any]
    ) -> web.StreamResponse:
        """One try. An UpstreamError leaves this with the call closed and the failure counted, before or after
        events reached the client. `extra`: fields the router adds to the body (an SLO's priority)."""
        path = reply.path
        prefill_body, decode_body = forward_bodies(raw, body, pair_fields(body, pair) | moves.fields() | extra)
        sent = time.monotonic()
        call = PairCall(self.pools, pair, path, prefill_body, decode_body, self.config.request_timeout_s)
        handed_to_stream = False
        try:
            resp = await call.open_decode()
            if not body.get("stream"):
                data = await read_all(resp, pair.decode)
                if wants_prompt_logprobs(path, body) and pair.prefill is not None:
                    data = PromptLogprobs(path, await call.prefill_answer).answer(data)
                else:  # a finished prefill answer keeps its connection for the next request
                    await asyncio.wait({call.prefill_answer}, timeout=PREFILL_GRACE_S)
                    if call.error is not None:  # the prefill failed while the decode answered
                        raise call.error
                return self._reply(path, json_response(data), pair, reply.start)
            first = await read_chunk(resp, pair.decode)
            if path != CHAT:  # a chat stream's first event is the role, not a token
                self.placer.first_token(pair, time.monotonic() - sent)
            prompt_logprobs = wants_prompt_logprobs(path, body) and pair.prefill is not None
            if reply.logprobs is None and prompt_logprobs:  # the first event must carry them
                reply.logprobs = PromptLogprobs(path, await call.prefill_answer)
            handed_to_stream = True
        except UpstreamError as e:
            call.close()  # first: a worker the failure takes out of rotation has this call no more
            self._count_failure(e)
            raise
        except asyncio.CancelledError:  # the client went away; closing the call aborts both halves
            self._client_left(path, pair, reply.start, "client disconnected before the response was ready")
            raise
        finally:
            if not handed_to_stream:
                call.close()
        stream = PairStream(call, resp, first, reply.logprobs, moves if moves.on else None)
        return await self._stream(reply, stream, moves)

    async def _stream(self, reply: Reply, stream: PairStream, moves: Moves) -> web.StreamResponse:
        """Relay one try's stream into the client's (started by the first try that has an event for it)."""
        pair = stream.call.pair
        try:
            async for events in stream.events():
                if reply.out is None:
                    reply.out = web.StreamResponse(headers=SSE_HEADERS)
                    await reply.out.prepare(reply.request)
                await reply.out.write(reply.relay.feed(events) if reply.relay else events)
                if (gap := moves.gap()) is not None:
                    self.metrics.resume_gap.observe(gap)
                if reply.relay is not None and reply.relay.ended:
                    break
        except (asyncio.CancelledError, ConnectionError) as e:  # the client went away
            self._client_left(reply.path, pair, reply.start, "client disconnected mid-stream", status=200)
            if isinstance(e, asyncio.CancelledError):
                raise
            return reply.out
        finally:
            stream.call.close()
        if stream.error is not None:
            self._count_failure(stream.error)
            raise stream.error
        await reply.out.write_eof()
        self._record(reply.path, 200, pair, reply.start, f"moved {moves.done} times" if moves.done else "")
        return reply.out

    def _client_left(self, path: str, pair: Pair, start: float, outcome: str, status: int = 499) -> None:
        self.metrics.cancelled.labels(CLIENT_DISCONNECTED).inc()
        self._record(path, status, pair, start, outcome)

    def _count_failure(self, e: UpstreamError) -> None:
        self.metrics.cancelled.labels(e.cause).inc()
        if e.upstream:
            self.metrics.upstream_errors.labels(e.worker.role).inc()
            if e.worker_failed:
                self.workers.mark(e.worker, False, str(e))

    def _reply(
        self, path: str, response: web.Response, pair: Pair | None, start: float, outcome: str = ""
    ) -> web.Response:
        self._record(path, response.status, pair, start, outcome)
        return response

    def _record(self, path: str, status: int, pair: Pair | None, start: float, outcome: str) -> None:
        counter = self.counters.get((path, status))
        if counter is None:
            counter = self.counters[path, status] = self.metrics.requests.labels(path, str(status))
        counter.inc()
        self.metrics.latency.observe(time.monotonic() - start)
        level = logging.INFO if outcome or status != 200 else logging.DEBUG  # every request is 7% of the CPU at INFO
        if log.isEnabledFor(level):
            where = "-" if pair is None else f"{pair.prefill.url if pair.prefill else 'local'} + {pair.decode.url}"
            note = f": {outcome}" if outcome else ""
            log.log(level, "%s -> %d via %s (%.1f ms)%s", path, status, where, 1000 * (time.monotonic() - start), note)
