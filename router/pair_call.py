"""One request in flight at a (prefill, decode) pair.

Both halves start at once. Guards run beside them: the prefill half itself (its failure ends the
call; its success just stops being watched), one watchdog per worker that fires when the health loop
takes the worker out of rotation (the prefill's only until the prefill half has answered), and, while nothing reached the client, one that polls for the
client going away. `guarded(work)` awaits a piece of work unless a guard fails first; `close()`
cancels everything left, and closing a worker's connection aborts the request there and frees its KV.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Coroutine, NoReturn, TypeVar

import aiohttp
from starlette.requests import Request

from router.upstream import client_disconnected, post, read_all, worker_dead
from router.workers import Worker

T = TypeVar("T")
CLIENT_POLL_S = 0.25


@dataclass
class Pair:
    prefill: Worker
    decode: Worker


def with_bootstrap(body: dict[str, Any], prefill: Worker) -> dict[str, Any]:
    """The body both halves get: where the decode finds this prefill (its registry, and its instance
    there when the prefill told us), and a fresh room id; whatever the client sent for these is replaced."""
    fields = {"bootstrap_host": prefill.registry_host, "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": random.getrandbits(63)}
    if prefill.instance_id:
        fields["prefill_instance_id"] = prefill.instance_id
    return {k: v for k, v in body.items() if k != "prefill_instance_id"} | fields


class PairCall:
    """Owns the tasks of one request at one pair; see the module docstring."""

    def __init__(self, session: aiohttp.ClientSession, pair: Pair, path: str, body: dict[str, Any]):
        self.pair = pair
        self.closed = False
        self.tasks: list[asyncio.Task] = []
        # the decode's request goes out first: the prefill's forward waits for the pages it reserves
        self.decode = self._spawn(post(session, pair.decode, path, body))
        self.prefill = self._spawn(_run_prefill(session, pair.prefill, path, body | {"stream": False}))
        prefill_down = self._spawn(_fail_when_down(pair.prefill, pair.prefill.down))
        self.guards = [self.prefill, prefill_down, self._spawn(_fail_when_down(pair.decode, pair.decode.down))]
        # once the prefill half has answered, the request no longer depends on that worker
        self.prefill.add_done_callback(lambda t: prefill_down.cancel() if not t.cancelled() and t.exception() is None else None)
        pair.prefill.in_flight += 1
        pair.decode.in_flight += 1

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(coro)
        task.add_done_callback(_retrieve)
        self.tasks.append(task)
        return task

    def watch_client(self, request: Request) -> asyncio.Task:
        """Guard against the client going away; cancel the returned task once the response is committed
        (from then on the streaming response notices the client itself)."""
        task = self._spawn(_fail_when_client_leaves(request))
        self.guards.append(task)
        return task

    async def guarded(self, work: Awaitable[T]) -> T:
        """`work`'s result, unless a guard fails first: then `work` is cancelled and the guard's error raised."""
        task = asyncio.ensure_future(work)
        task.add_done_callback(_retrieve)
        try:
            while True:
                self._raise_failed_guard()
                if task.done():
                    return task.result()
                watching = {g for g in self.guards if not g.done()}
                await asyncio.wait({task, *watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            task.cancel()

    def _raise_failed_guard(self) -> None:
        for g in self.guards:
            if g.done() and not g.cancelled() and g.exception() is not None:
                raise g.exception()

    def close(self) -> None:
        """Cancel what still runs (idempotent); synchronous, so it is safe in any `finally`."""
        if self.closed:
            return
        self.closed = True
        for task in self.tasks:
            task.cancel()
        if self.decode.done() and not self.decode.cancelled() and self.decode.exception() is None:
            self.decode.result().close()
        self.pair.prefill.in_flight -= 1
        self.pair.decode.in_flight -= 1


async def _run_prefill(session: aiohttp.ClientSession, worker: Worker, path: str, body: dict[str, Any]) -> bytes:
    resp = await post(session, worker, path, body)
    return await read_all(resp, worker)


async def _fail_when_down(worker: Worker, down: asyncio.Event) -> NoReturn:
    # `down` is the event current when the call started: a worker that recovers gets a fresh one
    await down.wait()
    raise worker_dead(worker)


async def _fail_when_client_leaves(request: Request) -> NoReturn:
    while not await request.is_disconnected():
        await asyncio.sleep(CLIENT_POLL_S)
    raise client_disconnected()


def _retrieve(task: asyncio.Task) -> None:
    """Mark a task's exception as seen: errors are read through guards, or are moot after close()."""
    if not task.cancelled():
        task.exception()
