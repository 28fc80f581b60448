"""Send one request to a (prefill, decode) pair at once and return the decode's answer.

    client ──▶ router ──▶ prefill (same body, stream off)   : its status decides failures
                      └─▶ decode  (same body)               : streamed back to the client
Either half failing cancels the other (closing its connection aborts the request there and frees
its KV). A worker that refuses the connection before any byte reached the client is retried once
with another pair.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp

from common.errors import error_body
from router.workers import Worker

log = logging.getLogger("tandem.router")


class UpstreamError(Exception):
    def __init__(self, status: int, body: bytes, worker: Worker | None, refused: bool = False):
        super().__init__(f"HTTP {status} from {worker.url if worker else 'router'}")
        self.status, self.body, self.worker, self.refused = status, body, worker, refused


@dataclass
class Pair:
    prefill: Worker
    decode: Worker


def with_bootstrap(body: dict[str, Any], prefill: Worker) -> dict[str, Any]:
    return body | {"bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
                   "bootstrap_room": random.getrandbits(63)}


async def post(session: aiohttp.ClientSession, worker: Worker, path: str, body: dict) -> aiohttp.ClientResponse:
    """POST and return once headers arrived; an error status raises UpstreamError with the body."""
    try:
        resp = await session.post(worker.url + path, json=body)
    except aiohttp.ClientConnectorError as e:
        raise UpstreamError(503, json.dumps(error_body(f"{worker.role} worker {worker.url} refused the connection: {e}", "upstream_unavailable", 503)).encode(), worker, refused=True) from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise UpstreamError(502, json.dumps(error_body(f"{worker.role} worker {worker.url} failed: {e!r}", "upstream_error", 502)).encode(), worker) from None
    if resp.status != 200:
        body_bytes = await resp.read()
        resp.release()
        raise UpstreamError(resp.status, body_bytes, worker)
    return resp


async def run_prefill(session: aiohttp.ClientSession, pair: Pair, path: str, body: dict) -> bytes:
    resp = await post(session, pair.prefill, path, body | {"stream": False})
    try:
        return await resp.read()
    finally:
        resp.release()


async def start_pair(session: aiohttp.ClientSession, pair: Pair, path: str, body: dict) -> tuple[aiohttp.ClientResponse, asyncio.Task]:
    """Both halves at once; returns the decode response (headers in) and the running prefill task.
    If the prefill fails first, the decode is cancelled and the prefill's error raised."""
    prefill = asyncio.create_task(run_prefill(session, pair, path, body))
    decode = asyncio.create_task(post(session, pair.decode, path, body))
    done, _ = await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
    if prefill in done and prefill.exception() is not None:
        await cancel(decode)
        raise prefill.exception()
    try:
        resp = await decode
    except UpstreamError:
        await cancel(prefill)
        raise
    return resp, prefill


async def cancel(task: asyncio.Task) -> None:
    task.cancel()
    try:
        result = await task
        if isinstance(result, aiohttp.ClientResponse):
            result.close()
    except BaseException:
        pass


async def complete(session: aiohttp.ClientSession, pair: Pair, path: str, body: dict) -> bytes:
    """Non-streaming: the decode's JSON, with the prefill's input logprobs merged in (SGLang semantics)."""
    resp, prefill = await start_pair(session, pair, path, body)
    try:
        decode_body = await resp.read()
    finally:
        resp.release()
    prefill_body = await prefill
    if path == "/generate" and body.get("return_logprob"):
        return merge_input_logprobs(prefill_body, decode_body)
    return decode_body


def merge_input_logprobs(prefill_body: bytes, decode_body: bytes) -> bytes:
    p, d = json.loads(prefill_body), json.loads(decode_body)
    pairs = zip(p, d) if isinstance(d, list) else [(p, d)]
    for pi, di in pairs:
        for key in ("input_token_logprobs", "input_top_logprobs"):
            if key in pi.get("meta_info", {}):
                di.setdefault("meta_info", {})[key] = pi["meta_info"][key]
    return json.dumps(d).encode()


async def stream(session: aiohttp.ClientSession, resp: aiohttp.ClientResponse, prefill: asyncio.Task) -> AsyncIterator[bytes]:
    """Pass the decode's SSE bytes through as they come; closing early aborts both halves."""
    finished = False
    try:
        async for chunk in resp.content.iter_any():
            yield chunk
        finished = True
    finally:
        resp.close()
        if not finished:
            await cancel(prefill)
        else:
            try:
                await asyncio.wait_for(asyncio.shield(prefill), timeout=5)
            except BaseException:
                await cancel(prefill)


def log_request(path: str, pair: Pair | None, status: int, start: float) -> None:
    where = f"{pair.prefill.url} + {pair.decode.url}" if pair else "-"
    log.info("%s -> %d via %s (%.1f ms)", path, status, where, 1000 * (time.monotonic() - start))
