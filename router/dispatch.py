"""Serving one generation request: admission, the body, a (prefill, decode) pair, one retry on another
pair when a worker refused before anything reached the client, and the reply (plain or streamed).

The body is parsed once (to check it and read the few fields the router needs) and forwarded as the
client's own bytes with the bootstrap fields appended: JSON parsers keep the last of duplicate keys.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from common.wire.body import parse_json_object, read_limited
from common.wire.errors import TandemError, error_body
from router.admission import Admission
from router.config import RouterConfig
from router.http1 import Pools
from router.logprobs import PromptLogprobs, wants_prompt_logprobs
from router.metrics import RouterMetrics
from router.pair_call import Pair, PairCall, pair_fields
from router.pair_stream import PairStream
from router.placement import Placer
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
        """`placer`: picks each try's pair (router/placement.py)."""
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
        except TandemError as e:
            return self._reply(path, json_response(e.to_dict(), e.status, e.headers), None, start)
        return await self.dispatch(path, request, raw, body, start, hints)

    async def dispatch(
        self,
        path: str,
        request: web.Request,
        raw: bytes,
        body: dict[str, Any],
        start: float,
        hints: RequestHints = NONE,
    ) -> web.StreamResponse:
        """A request read and parsed (`raw` its bytes, `body` its JSON, `hints` its placement headers) through a
        pair, once admitted (429 if not)."""
        if not self.admission.try_enter():
            limit = self.admission.limit
            error = error_body(
                f"the router has {limit} requests in flight, its limit; retry later", "overloaded_error", 429
            )
            return self._reply(path, json_response(error, 429, {"Retry-After": "1"}), None, start)
        try:
            return await self._handle_admitted(path, request, raw, body, start, hints)
        finally:
            self.admission.leave()

    async def _handle_admitted(
        self, path: str, request: web.Request, raw: bytes, body: dict[str, Any], start: float, hints: RequestHints
    ) -> web.StreamResponse:
        exclude: set[str] = set()
        error: UpstreamError | None = None
        extra = self._slo_fields(body, hints)
        for attempt in (1, 2):
            pair = self.placer.pick(body, exclude, hints)
            if pair is None:
                return self._no_pair(path, error, start)
            try:
                return await self._serve_on(pair, path, request, raw, body, start, extra)
            except UpstreamError as e:
                error = e
                if not (e.retriable and attempt == 1 and e.worker is not None):
                    return self._reply(path, json_response(e.body, e.status, e.headers), pair, start, f"{e.cause}: {e}")
                log.info("retrying on another pair: %s", e)
                exclude.add(e.worker.url)
                self.metrics.retries.inc()
        raise AssertionError("unreachable: the second attempt always returns")

    def _no_pair(self, path: str, error: UpstreamError | None, start: float) -> web.Response:
        if error is not None:  # the retry found no other pair: the first failure is the better answer
            return self._reply(
                path, json_response(error.body, error.status, error.headers), None, start, f"{error.cause}: {error}"
            )
        msg = "no healthy prefill and decode worker pair is available; retry later"
        return self._reply(
            path, json_response(error_body(msg, "overloaded_error", 503), 503, {"Retry-After": "1"}), None, start
        )

    def _slo_fields(self, body: dict[str, Any], hints: RequestHints) -> dict[str, Any]:
        """With --slo-priority, a request's priority from its TTFT target, unless it has one."""
        priority = hints.priority() if self.config.slo_priority and body.get("priority") is None else None
        return {"priority": priority} if priority is not None else {}

    async def _serve_on(
        self,
        pair: Pair,
        path: str,
        request: web.Request,
        raw: bytes,
        body: dict[str, Any],
        start: float,
        extra: dict[str, Any],
    ) -> web.StreamResponse:
        """One attempt. An UpstreamError before anything reached the client leaves this with the call closed
        and the failure counted; once a stream started, failures become its last event. `extra`: fields the
        router adds to the body (an SLO's priority)."""
        prefill_body, decode_body = forward_bodies(raw, body, pair_fields(body, pair) | extra)
        sent = time.monotonic()
        call = PairCall(self.pools, pair, path, prefill_body, decode_body, self.config.request_timeout_s)
        logprobs: PromptLogprobs | None = None
        handed_to_stream = False
        try:
            resp = await call.open_decode()
            if not body.get("stream"):
                data = await read_all(resp, pair.decode)
                prefill_answer = await call.prefill_answer
                if wants_prompt_logprobs(path, body) and pair.prefill is not None:
                    data = PromptLogprobs(path, prefill_answer).answer(data)
                return self._reply(path, json_response(data), pair, start)
            first = await read_chunk(resp, pair.decode)
            if path != CHAT:  # a chat stream's first event is the role, not a token
                self.placer.first_token(pair, time.monotonic() - sent)
            if wants_prompt_logprobs(path, body) and pair.prefill is not None:  # the first event must carry them
                logprobs = PromptLogprobs(path, await call.prefill_answer)
            handed_to_stream = True
        except UpstreamError as e:
            call.close()  # first: a worker the failure takes out of rotation has this call no more
            self._count_failure(e)
            raise
        except asyncio.CancelledError:  # the client went away; closing the call aborts both halves
            self._client_left(path, pair, start, "client disconnected before the response was ready")
            raise
        finally:
            if not handed_to_stream:
                call.close()
        return await self._stream(request, PairStream(call, resp, first, logprobs), path, start)

    async def _stream(self, request: web.Request, stream: PairStream, path: str, start: float) -> web.StreamResponse:
        out = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await out.prepare(request)
            async for events in stream.events():
                await out.write(events)
            await out.write_eof()
        except (asyncio.CancelledError, ConnectionError) as e:  # the client went away
            self._client_left(path, stream.call.pair, start, "client disconnected mid-stream", status=200)
            if isinstance(e, asyncio.CancelledError):
                raise
            return out
        finally:
            stream.call.close()
        outcome = ""
        if stream.error is not None:
            self._count_failure(stream.error)
            outcome = f"stream ended with an error event: {stream.error.cause}: {stream.error}"
        self._record(path, 200, stream.call.pair, start, outcome)
        return out

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
