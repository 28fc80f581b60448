"""One request in flight at a (prefill, decode) pair.

    client ──▶ router ──▶ prefill (same body, stream off)   : its failure ends the request
                      └─▶ decode  (same body)               : its answer goes back to the client

A local placement (the decode computes the prompt itself, docs/placement.md) has no prefill half: its
`prefill_answer` is empty and done from the start.

Both halves start at once: the handler awaits the decode half, the prefill half reports its end by
itself (a callback, no task). The first failure ends the call (`fail`): the prefill half's own error,
or either worker taken out of rotation (the prefill only until it has answered: from then on the
request no longer depends on it). A decode with --kv-load-failure-policy recompute (`Worker.recomputes`)
computes the prompt itself when its KV does not come: the prefill's failure then ends only the prefill half
(`prefill_answer` holds the error), and the decode's answer goes on, unless the prefill refused the role it was
meant for (no prefill will send that KV: the request moves). Ending the call makes the decode answer's waits raise that error and
closes both connections, which aborts the request on the workers and frees its KV. A client that goes
away cancels the handler, whose `close()` does the same. Nothing here polls or runs a task of its own.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from common.wire.api import ROLE_HEADER
from router.http1 import Pools, Response
from router.upstream import CLIENT_ERROR, UpstreamError, answer_error, send, worker_dead
from router.workers import Worker

# each half names the role it is meant for: a worker whose role was switched refuses it at once
# (common/http/role_guard.py), the router follows the refusal's role headers and moves the request (router/dispatch.py)
ROLE_LINE = {role: f"{ROLE_HEADER}: {role}\r\n".encode() for role in ("prefill", "decode")}
ROUTER_FIELDS = frozenset(
    {"prefill_instance_id", "migration", "pd_placement"}
)  # the router's alone: a client's are dropped


@dataclass
class Pair:
    """Where one try of a request runs (router/placement/placer.py): a prefill and a decode, or a decode alone that
    computes the prompt itself (`prefill` None, path local)."""

    prefill: Worker | None
    decode: Worker
    path: str = "remote_suffix"  # remote_suffix | remote_full (what crosses) | local: tandem_router_placement_total
    reason: str = "policy"  # why this path (the metric's other label)
    tpot_slo_s: float | None = None  # the request's x-slo-tpot-ms: a local prefill on its decode must respect it
    option: Any = None  # the cost placement's priced option (router/placement/cost.py), to learn from its TTFT


def pair_fields(body: dict[str, Any], pair: Pair) -> dict[str, Any]:
    """The body the workers get: with the rendezvous fields (with_bootstrap), or, for a decode that computes the
    prompt itself, `pd_placement` local and none."""
    if pair.prefill is None:
        return {k: v for k, v in body.items() if k not in ROUTER_FIELDS} | {"pd_placement": "local"}
    return with_bootstrap(body, pair.prefill)


def with_bootstrap(body: dict[str, Any], prefill: Worker) -> dict[str, Any]:
    """The body both halves get: where the decode finds this prefill (its registry, and its instance
    there when the prefill told us), and a fresh room id; whatever the client sent for these (and for
    `migration` and `pd_placement`, the router's own) is replaced or dropped."""
    fields = {
        "bootstrap_host": prefill.registry_host,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }
    if prefill.instance_id:
        fields["prefill_instance_id"] = prefill.instance_id
    return {k: v for k, v in body.items() if k not in ROUTER_FIELDS} | fields


class PairCall:
    """Owns both halves of one request at one pair; see the module docstring. `prefill_answer` resolves to
    the prefill's body, or to the error that ended the call."""

    def __init__(self, pools: Pools, pair: Pair, path: str, prefill_body: bytes, decode_body: bytes, timeout: float):
        self.pair, self.error, self.closed = pair, None, False
        self.workers = [w for w in (pair.prefill, pair.decode) if w is not None]
        self.decode = pools.get(pair.decode.url, pair.decode.tls_name).post(
            path, decode_body, timeout, headers=ROLE_LINE["decode"]
        )
        self.prefill_answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._prefill = None
        if pair.prefill is not None:
            self._prefill = pools.get(pair.prefill.url, pair.prefill.tls_name).post(
                path, prefill_body, timeout, on_done=self._prefill_done, headers=ROLE_LINE["prefill"]
            )
        else:  # a local placement: the decode's answer is the whole answer
            self.prefill_answer.set_result(b"")
        for w in self.workers:
            w.calls.add(self)
            w.in_flight += 1
        if self._prefill is not None:
            self._prefill.start()

    async def open_decode(self) -> Response:
        """The decode's answer once its headers arrived (an error status raises UpstreamError)."""
        return await send(self.decode, self.pair.decode)

    def _prefill_done(self, resp: Response) -> None:
        error = answer_error(resp, self.pair.prefill)
        if error is not None:
            self._prefill_lost(error) if self._decode_goes_on(error) else self.fail(error)
            return
        self.pair.prefill.calls.discard(self)
        if not self.prefill_answer.done():
            self.prefill_answer.set_result(resp.body())

    def worker_down(self, worker: Worker) -> None:
        error = worker_dead(worker)
        if worker is self.pair.prefill and self._decode_goes_on(error):
            self._prefill_lost(error)
        else:
            self.fail(error)

    def _decode_goes_on(self, error: UpstreamError) -> bool:
        """Whether the decode answers without this prefill failure's KV: it recomputes, and the failure is the
        prefill's (not the client request's, nor a refusal of its role)."""
        if error.cause == CLIENT_ERROR or error.role_headers is not None:
            return False
        return self.pair.decode.recomputes and not self.closed and self.error is None

    def _prefill_lost(self, error: UpstreamError) -> None:
        self.pair.prefill.calls.discard(self)
        if not self.prefill_answer.done():
            self.prefill_answer.set_exception(error)
            self.prefill_answer.exception()  # seen: only a client that wants the prompt's logprobs needs it

    def fail(self, error: UpstreamError) -> None:
        """End the call with `error` (the first failure wins); the decode answer's waits raise it."""
        if self.closed or self.error is not None:
            return
        self.error = error
        self.decode.fail(error)
        if self._prefill is not None:
            self._prefill.fail(error)
        if not self.prefill_answer.done():
            self.prefill_answer.set_exception(error)
            self.prefill_answer.exception()  # seen: whoever awaits it gets it; nobody may, and that is fine

    def close(self) -> None:
        """Let go of both halves (idempotent): an unfinished one has its connection closed."""
        if self.closed:
            return
        self.closed = True
        self.decode.close()
        if self._prefill is not None:
            self._prefill.close()
        for w in self.workers:
            w.calls.discard(self)
            w.in_flight -= 1
