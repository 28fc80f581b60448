"""Send one request to a (prefill, decode) pair at once and return the decode's answer.

    client ──▶ router ──▶ prefill (same body, stream off)   : its failure ends the request
                      └─▶ decode  (same body)               : its answer goes back to the client
Either half failing cancels the other at once (closing its connection aborts the request there and
frees its KV), and so do a worker taken out of rotation and a client that goes away.
"""
from __future__ import annotations

import json
import logging
import time

import aiohttp

from router.pair_call import Pair, PairCall
from router.upstream import read_all, read_chunk

log = logging.getLogger("tandem.router")


async def complete(call: PairCall, path: str, body: dict) -> bytes:
    """Non-streaming: the decode's JSON, with the prefill's input logprobs merged in (SGLang semantics).
    Both halves race: whichever fails first ends the call with its error."""
    resp = await call.guarded(call.decode)
    decode_body = await call.guarded(read_all(resp, call.pair.decode))
    prefill_body = await call.guarded(call.prefill)
    if path == "/generate" and body.get("return_logprob"):
        return merge_input_logprobs(prefill_body, decode_body)
    return decode_body


async def open_stream(call: PairCall) -> tuple[aiohttp.ClientResponse, bytes]:
    """Streaming: the decode's response and its first bytes. Until they arrive nothing has reached the
    client, so a failure still becomes a plain HTTP error (and may be retried on another pair)."""
    resp = await call.guarded(call.decode)
    first = await call.guarded(read_chunk(resp, call.pair.decode))
    return resp, first


def merge_input_logprobs(prefill_body: bytes, decode_body: bytes) -> bytes:
    p, d = json.loads(prefill_body), json.loads(decode_body)
    pairs = zip(p, d) if isinstance(d, list) else [(p, d)]
    for pi, di in pairs:
        for key in ("input_token_logprobs", "input_top_logprobs"):
            if key in pi.get("meta_info", {}):
                di.setdefault("meta_info", {})[key] = pi["meta_info"][key]
    return json.dumps(d).encode()


def log_request(path: str, pair: Pair | None, status: int, start: float, outcome: str = "") -> None:
    """The one log line of a request."""
    where = f"{pair.prefill.url} + {pair.decode.url}" if pair else "-"
    note = f": {outcome}" if outcome else ""
    log.info("%s -> %d via %s (%.1f ms)%s", path, status, where, 1000 * (time.monotonic() - start), note)
