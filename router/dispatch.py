"""Serving one generation request: admission, the body, a (prefill, decode) pair, one retry on another
pair when a worker refused before anything reached the client, and the reply (plain or streamed)."""
from __future__ import annotations

import json
import logging
import time

import aiohttp
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from common.wire.body import read_json_object
from common.wire.errors import TandemError, error_body
from router.admission import Admission
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.pair_call import Pair, PairCall, with_bootstrap
from router.pair_stream import PairStream, PairStreamResponse
from router.policies import make_policy
from router.proxy import complete, log_request, open_stream
from router.upstream import CLIENT_DISCONNECTED, UpstreamError
from router.workers import WorkerRegistry

log = logging.getLogger("tandem.router")


class Dispatcher:
    """Routes generation requests; `session` is set while the app runs (see the app's lifespan)."""

    def __init__(self, config: RouterConfig, workers: WorkerRegistry, metrics: RouterMetrics, admission: Admission):
        self.config, self.workers, self.metrics, self.admission = config, workers, metrics, admission
        self.prefill_policy = make_policy(config.policy)
        self.decode_policy = make_policy("power_of_two" if config.policy == "cache_aware" else config.policy)
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, path: str, request: Request) -> Response:
        start = time.monotonic()
        if not self.admission.try_enter():
            limit = self.admission.limit
            body = error_body(f"the router has {limit} requests in flight, its limit; retry later", "overloaded_error", 429)
            return self._reply(path, JSONResponse(body, 429, headers={"Retry-After": "1"}), None, start)
        streaming = False
        try:
            response = await self._handle_admitted(path, request, start)
            streaming = isinstance(response, PairStreamResponse)  # the stream gives the slot back when it ends
            return response
        finally:
            if not streaming:
                self.admission.leave()

    async def _handle_admitted(self, path: str, request: Request, start: float) -> Response:
        try:
            body = await read_json_object(request, self.config.max_request_bytes)
        except TandemError as e:
            return self._reply(path, JSONResponse(e.to_dict(), e.status, headers=e.headers), None, start)
        key, exclude = _prompt_key(body), set()
        error: UpstreamError | None = None
        for attempt in (1, 2):
            pair = self._pick_pair(key, exclude)
            if pair is None:
                return self._no_pair(path, error, start)
            try:
                return await self._serve_on(pair, path, request, body, start)
            except UpstreamError as e:
                error = e
                if not (e.retriable and attempt == 1 and e.worker is not None):
                    return self._reply(path, JSONResponse(e.body, e.status, headers=e.headers), pair, start, f"{e.cause}: {e}")
                log.info("retrying on another pair: %s", e)
                exclude.add(e.worker.url)
                self.metrics.retries.inc()
        raise AssertionError("unreachable: the second attempt always returns")

    def _pick_pair(self, key: str, exclude: set[str]) -> Pair | None:
        prefills = [w for w in self.workers.healthy("prefill") if w.url not in exclude]
        decodes = [w for w in self.workers.healthy("decode") if w.url not in exclude]
        if not prefills or not decodes:
            return None
        return Pair(self.prefill_policy.pick(prefills, key), self.decode_policy.pick(decodes, key))

    def _no_pair(self, path: str, error: UpstreamError | None, start: float) -> Response:
        if error is not None:  # the retry found no other pair: the first failure is the better answer
            return self._reply(path, JSONResponse(error.body, error.status, headers=error.headers), None, start, f"{error.cause}: {error}")
        msg = "no healthy prefill and decode worker pair is available; retry later"
        return self._reply(path, JSONResponse(error_body(msg, "overloaded_error", 503), 503, headers={"Retry-After": "1"}), None, start)

    async def _serve_on(self, pair: Pair, path: str, request: Request, body: dict, start: float) -> Response:
        """One attempt; an UpstreamError leaves this with the call closed and the failure counted."""
        call = PairCall(self.session, pair, path, with_bootstrap(body, pair.prefill))
        handed_to_stream = False
        try:
            client_watch = call.watch_client(request)
            if not body.get("stream"):
                data = await complete(call, path, body)
                return self._reply(path, Response(data, 200, media_type="application/json"), pair, start)
            resp, first = await open_stream(call)
            client_watch.cancel()  # the streaming response notices a client that goes away from here on
            handed_to_stream = True
            return PairStreamResponse(PairStream(call, resp, first), lambda s: self._stream_ended(path, s, start))
        except UpstreamError as e:
            self._count_failure(e)
            raise
        finally:
            if not handed_to_stream:
                call.close()

    def _stream_ended(self, path: str, stream: PairStream, start: float) -> None:
        stream.call.close()
        self.admission.leave()
        outcome = ""
        if stream.error is not None:
            self._count_failure(stream.error)
            outcome = f"stream ended with an error event: {stream.error.cause}: {stream.error}"
        elif not stream.finished:
            self.metrics.cancelled.labels(CLIENT_DISCONNECTED).inc()
            outcome = "client disconnected mid-stream"
        self._record(path, 200, stream.call.pair, start, outcome)

    def _count_failure(self, e: UpstreamError) -> None:
        self.metrics.cancelled.labels(e.cause).inc()
        if e.worker is not None:
            self.metrics.upstream_errors.labels(e.worker.role).inc()
            if e.worker_failed:
                self.workers.mark(e.worker, False, str(e))

    def _reply(self, path: str, response: Response, pair: Pair | None, start: float, outcome: str = "") -> Response:
        self._record(path, response.status_code, pair, start, outcome)
        return response

    def _record(self, path: str, status: int, pair: Pair | None, start: float, outcome: str) -> None:
        self.metrics.requests.labels(path, str(status)).inc()
        self.metrics.latency.observe(time.monotonic() - start)
        log_request(path, pair, status, start, outcome)


def _prompt_key(body: dict) -> str:
    for key in ("text", "prompt"):
        if isinstance(body.get(key), str):
            return body[key]
    if isinstance(body.get("messages"), list):
        return json.dumps(body["messages"])[:4096]
    if isinstance(body.get("input_ids"), list):
        return ",".join(map(str, body["input_ids"][:1024]))
    return ""
