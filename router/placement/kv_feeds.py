"""The router's subscriptions to its workers' KV cache events (common/wire/kv_events.py), kept in a KVIndex.

`KVFeeds.follow` learns each healthy worker's event endpoint from its `/get_server_info` (`kv_events`) and
subscribes; a worker whose instance id changes (it restarted) is subscribed anew, its pages forgotten first.
`WorkerFeed` applies a worker's batches in sequence order. A batch after a gap is preceded by the missed range,
asked from the worker's replay socket; when the replay cannot give all of it, or the sequence goes backwards
(the publisher restarted), the worker's pages are forgotten and the index rebuilt from the events that follow:
the index may under-count a worker's pages, never trust stale ones.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import zmq
import zmq.asyncio

from common.wire.kv_events import END_SEQ, decode_batch
from router.placement.kv_index import KVIndex
from router.workers import Worker, WorkerRegistry

log = logging.getLogger("tandem.router")
REPLAY_TIMEOUT_S = 2.0
FOLLOW_INTERVAL_S = 0.5


class WorkerFeed:
    """Follows one worker's event stream into the index."""

    def __init__(self, ctx: zmq.asyncio.Context, index: KVIndex, url: str, info: dict[str, Any]):
        self.ctx, self.index, self.url = ctx, index, url
        self.endpoint, self.replay_endpoint = info["endpoint"], info.get("replay_endpoint")
        self.topic: bytes = (info.get("topic") or "").encode()
        self.block_size: int = info["block_size"]
        self.next_seq: int | None = None
        self.resyncs = 0
        self.batches = 0

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) == 3:
                    await self.on_batch(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)

    async def on_batch(self, seq: int, payload: bytes) -> None:
        if self.next_seq is not None and seq < self.next_seq:  # the publisher started over
            self._resync(f"its event sequence went back from {self.next_seq} to {seq}")
            self.next_seq = 0
        if seq != (self.next_seq or 0):
            await self._catch_up(seq)
        self._apply(seq, payload)

    async def _catch_up(self, seq: int) -> None:
        """Apply batches [next_seq, seq) from the replay socket, or forget the worker's pages if it cannot."""
        start = self.next_seq or 0
        missed = await self._replay(start) if self.replay_endpoint else []
        missed = [(s, p) for s, p in missed if start <= s < seq]
        if [s for s, _ in missed] == list(range(start, seq)):
            for s, p in missed:
                self._apply(s, p)
            return
        self._resync(f"its events {start}..{seq - 1} were missed and could not be replayed")

    def _resync(self, why: str) -> None:
        self.resyncs += 1
        log.warning("KV index: forgetting worker %s's %d pages: %s", self.url, self.index.pages(self.url), why)
        self.index.clear(self.url)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        try:
            _, events = decode_batch(payload)
        except ValueError as e:
            self._resync(str(e))
            return
        self.index.apply(self.url, events)
        self.batches += 1

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while await dealer.poll(int(REPLAY_TIMEOUT_S * 1000)):
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or frames[1] == END_SEQ:
                    return got
                got.append((int.from_bytes(frames[1], "big"), frames[2]))
            log.warning("KV events replay from %s timed out after %g s", self.replay_endpoint, REPLAY_TIMEOUT_S)
            return []
        finally:
            dealer.close(linger=0)


class KVFeeds:
    """One WorkerFeed per worker that publishes events; workers that do not publish hold nothing in the index."""

    def __init__(self, workers: WorkerRegistry, index: KVIndex):
        self.workers, self.index = workers, index
        self.ctx = zmq.asyncio.Context()
        self.feeds: dict[str, tuple[str | None, WorkerFeed | None, asyncio.Task | None]] = {}
        self.model_path: str | None = None  # a worker's model directory (the router's tokenizer comes from it)
        self.dropped_resyncs = 0  # resyncs of feeds since replaced

    @property
    def resyncs(self) -> int:
        """Times a worker's pages were forgotten after a gap or a sequence going back (restarts aside)."""
        return self.dropped_resyncs + sum(f.resyncs for _, f, _ in self.feeds.values() if f is not None)

    def block_size(self) -> int | None:
        return next((f.block_size for _, f, _ in self.feeds.values() if f is not None), None)

    async def follow(self, session: aiohttp.ClientSession) -> None:
        try:
            while True:
                try:
                    await self.refresh(session)
                except Exception:  # a bug here must not stop following for good
                    log.exception("KV events: refreshing the subscriptions failed")
                await asyncio.sleep(FOLLOW_INTERVAL_S)
        finally:
            for url in list(self.feeds):
                self._drop(url)
            self.ctx.destroy(linger=0)

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        for url in [u for u in self.feeds if u not in self.workers.workers]:
            self._drop(url)
        for w in list(self.workers.workers.values()):
            known = self.feeds.get(w.url)
            if w.healthy and (known is None or known[0] != w.instance_id):
                await self._subscribe(session, w)

    async def _subscribe(self, session: aiohttp.ClientSession, w: Worker) -> None:
        try:
            async with session.get(w.url + "/get_server_info", timeout=aiohttp.ClientTimeout(total=10)) as r:
                info = await r.json() if r.status == 200 else None
                info = info if isinstance(info, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            log.warning("KV events: GET %s/get_server_info failed: %s", w.url, e)
            return
        self._drop(w.url)
        if info is None:  # not a Tandem server (or an old one): it publishes no events
            self.feeds[w.url] = (w.instance_id, None, None)
            return
        self.model_path = self.model_path or info.get("model_path")
        events = info.get("kv_events")
        if events is None:
            self.feeds[w.url] = (w.instance_id, None, None)
            return
        feed = WorkerFeed(self.ctx, self.index, w.url, events)
        self.feeds[w.url] = (w.instance_id, feed, asyncio.create_task(feed.run()))
        log.info("KV events: following %s worker %s at %s", w.role, w.url, feed.endpoint)

    def _drop(self, url: str) -> None:
        _, feed, task = self.feeds.pop(url, (None, None, None))
        self.dropped_resyncs += feed.resyncs if feed is not None else 0
        if task is not None:
            task.cancel()
        self.index.clear(url)
