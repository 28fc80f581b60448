"""Publishes the radix cache's changes as vLLM-format KV cache events (common/wire/kv_events.py).

The cache calls `stored`/`removed`/`cleared` on the scheduler thread; each only appends to a bounded queue
(`max_queue_size`), so publishing never blocks the scheduler. A publisher thread hashes the pages, batches
what is queued into one `EventBatch`, numbers it, sends it on the PUB socket (which drops rather than blocks for
a subscriber past its high-water mark) and keeps the last `buffer_steps` batches for the replay socket.

The cache reports its keys (Req.cache_key): under a LoRA adapter, the tokens offset into its namespace. The
scheduler thread names the adapter as the change is queued (`adapter_name`: its lora_id to its name, as the server
numbers them now); the publisher thread takes the offset off and roots the page hashes in the adapter's name
(common/wire/kv_events.py `adapter_root`), and BlockStored carries both lora_id and lora_name, as vLLM's does.

An event that does not fit in the queue is dropped and counted; the next one that fits is preceded by
`AllBlocksCleared`, so a subscriber forgets what it can no longer trust: it may under-count this worker's
pages afterwards, never over-count them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from common.core.request import key_lora_id, key_token_ids
from common.wire.kv_events import (
    END_SEQ,
    KVEventsConfig,
    adapter_root,
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
    external_hash,
    page_digests,
)

log = logging.getLogger(__name__)
MAX_BATCH_EVENTS = 1024
PERIOD_S = 0.02
CLEARED = ("cleared", [], 0, "", None)
Item = tuple[str, list[int], int, str, str | None]  # (kind, cache keys, start, medium, the adapter's name)


def no_adapters(lora_id: int) -> str | None:
    return None


class KVEventPublisher:
    """A CacheListener that publishes; `endpoint`/`replay_endpoint` are the bound addresses (for subscribers).
    `adapter_name`: a lora_id's adapter name (--enable-lora), called on the scheduler thread."""

    def __init__(
        self,
        config: KVEventsConfig,
        page_size: int,
        public_host: str,
        adapter_name: Callable[[int], str | None] = no_adapters,
    ):
        self.config, self.page_size, self.adapter_name = config, page_size, adapter_name
        self.queue: queue.Queue[Item] = queue.Queue(config.max_queue_size)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.dropped = self.batches = 0
        self._lost = False  # an event was dropped: the next queued event must be AllBlocksCleared
        self._seq = 0
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.set_hwm(config.hwm)
        self.endpoint = self._bind(self.pub, config.endpoint, public_host)
        self.replay = self._ctx.socket(zmq.ROUTER) if config.replay_endpoint else None
        self.replay_endpoint = self._bind(self.replay, config.replay_endpoint, public_host) if self.replay else None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV cache events: PUB %s, replay %s, topic %r", self.endpoint, self.replay_endpoint, config.topic)

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str, public_host: str) -> str:
        """Bind and return the address a subscriber dials (a wildcard host becomes this server's public one)."""
        sock.bind(endpoint)
        bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        scheme, _, rest = bound.partition("://")
        host, _, port = rest.rpartition(":")
        return f"{scheme}://{public_host}:{port}" if host in ("0.0.0.0", "[::]", "*") else bound

    def info(self) -> dict[str, Any]:
        """What /get_server_info says about the events, for subscribers such as the router."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.config.topic,
            "block_size": self.page_size,
        }

    # -- CacheListener (scheduler thread) ------------------------------------------------------------
    def stored(self, tokens: list[int], start: int, medium: str) -> None:
        self._put(("stored", tokens, start, medium, self._adapter(tokens)))

    def removed(self, tokens: list[int], start: int, medium: str) -> None:
        self._put(("removed", tokens, start, medium, self._adapter(tokens)))

    def _adapter(self, tokens: list[int]) -> str | None:
        lora_id = key_lora_id(tokens)
        return self.adapter_name(lora_id) if lora_id else None

    def cleared(self) -> None:
        self._put(CLEARED)

    def _put(self, item: Item) -> None:
        try:
            if self._lost:
                self.queue.put_nowait(CLEARED)
                self._lost = False
            self.queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            self._lost = True

    # -- publisher thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        """Every PERIOD_S: replay requests, then what was queued meanwhile as one batch. Polling, not waking per
        event, so the scheduler thread hands this thread the GIL at most once per period."""
        while self._running:
            time.sleep(PERIOD_S)
            if self.replay is not None and self.replay.poll(0):
                self._serve_replay()
            items = []
            while len(items) < MAX_BATCH_EVENTS:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            if items:
                self._publish([self._event(*item) for item in items])

    def _event(self, kind: str, keys: list[int], start: int, medium: str, lora_name: str | None) -> list[Any]:
        if kind == "cleared":
            return all_blocks_cleared()
        tokens = key_token_ids(keys)
        digests = page_digests(tokens, self.page_size, adapter_root(lora_name))
        first = start // self.page_size
        hashes = [external_hash(d) for d in digests[first:]]
        if kind == "removed":
            return block_removed(hashes, medium)
        parent = external_hash(digests[first - 1]) if first else None
        lora_id = key_lora_id(keys) or None
        return block_stored(hashes, parent, tokens[start:], self.page_size, medium, lora_id, lora_name)

    def _publish(self, events: list[list[Any]]) -> None:
        payload = encode_batch(time.time(), events)
        seq, self._seq = self._seq, self._seq + 1
        try:
            self.pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # PUB drops for slow subscribers itself; this is belt and braces
            pass
        self.buffer.append((seq, payload))
        self.batches += 1

    def _serve_replay(self) -> None:
        """One replay request: every buffered batch from the asked sequence number on, then END_SEQ."""
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("a KV event replay request of %d frames was ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self.buffer):
            if seq >= start:
                self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2)
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
