"""Prefill side: one thread per decode instance executes that decode's queued chunks in order, so a
slow or frozen decode delays only its own rooms. A room's failure status goes through the same queue,
so it can never overtake a write of that room still in flight: once decode reads "failed", nothing
more lands in its pages and it may reuse them."""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transfer.messages import Status
from transfer.poll import KVPoll

if TYPE_CHECKING:
    from transfer.manager import RoomState
    from transfer.prefill_manager import PrefillKVManager

log = logging.getLogger(__name__)
IDLE_EXIT_S = 30.0


@dataclass
class Chunk:
    room: int
    state: "RoomState"
    src_pages: list[int]
    dst_pages: list[int]
    aux: bytes | None  # set on the last chunk: the record written after the pages


@dataclass
class FailureNotice:
    room: int
    state: "RoomState"


class TransferWorker:
    def __init__(self, manager: "PrefillKVManager", decode_id: str):
        self.manager = manager
        self.decode_id = decode_id
        self.queue: queue.Queue[Chunk | FailureNotice] = queue.Queue()
        self.alive = True
        self._backlog: list[Chunk | FailureNotice] = []
        threading.Thread(target=self._loop, name=f"kv-transfer-{decode_id[-6:]}", daemon=True).start()

    def _loop(self) -> None:
        while not self.manager.stopped:
            item = self._next()
            if item is None:
                if self.manager.retire_worker_if_idle(self):
                    return
            elif isinstance(item, FailureNotice):
                self._send_failure(item.room, item.state)
            else:
                self._run(self._merge_queued(item))

    def _next(self) -> Chunk | FailureNotice | None:
        if self._backlog:
            return self._backlog.pop(0)
        try:
            return self.queue.get(timeout=IDLE_EXIT_S)
        except queue.Empty:
            return None

    def _merge_queued(self, chunk: Chunk) -> Chunk:
        """Chunks of one room that queued up while the previous copy ran go out as one batch, so runs
        that continue across chunk boundaries become single pieces."""
        while chunk.aux is None:
            try:
                nxt = self.queue.get_nowait()
            except queue.Empty:
                break
            if not isinstance(nxt, Chunk) or nxt.room != chunk.room:
                self._backlog.append(nxt)
                break
            chunk = Chunk(chunk.room, chunk.state, chunk.src_pages + nxt.src_pages, chunk.dst_pages + nxt.dst_pages, nxt.aux)
        return chunk

    def _run(self, c: Chunk) -> None:
        if c.state.poll.done:
            return  # failed or aborted: the rest of its chunks are dropped; its notice follows
        try:
            self.manager.write_chunk(c.state.request, c.src_pages, c.dst_pages, c.aux)
        except Exception as e:
            log.warning("room %d: transfer to %s failed: %s", c.room, self.decode_id, e)
            if c.state.poll.fail(f"transfer error: {e}"):
                self.manager.counters["rooms_failed"] += 1
                self._send_failure(c.room, c.state)
            return
        self.manager.counters["chunks_sent"] += 1
        if c.aux is not None and c.state.poll.advance(KVPoll.Success):
            self.manager.counters["rooms_succeeded"] += 1
            self.manager.send_status(c.state.request, Status(c.room, True, ""))

    def _send_failure(self, room: int, state: "RoomState") -> None:
        self.manager.send_status(state.request, Status(room, False, state.poll.reason or "failed"))
