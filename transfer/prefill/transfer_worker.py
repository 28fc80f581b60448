"""Prefill side: one worker per decode instance executes that decode's queued chunks in order, so a slow
or frozen decode delays only its own rooms.

A room's final status always comes from its decode's worker, after that room's last write: "ok" right
after the write that carried the aux record, "failed" from the top of the worker's loop, where no write
is in flight. So once a decode reads a status, nothing more lands in that room's pages.

Bounds: at most `max_chunks` chunks wait per decode (a full queue fails the room, it never blocks the
scheduler); a worker whose thread dies of a bug fails its rooms naming the cause, and the pool starts a
new one for the next chunk. With `threaded=False` nothing runs on its own: `run_once()` does one step
(tests drive it).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from transfer.bulk_priority import lower_this_thread
from transfer.prefill.prefill_rooms import PrefillRoomState

log = logging.getLogger(__name__)
IDLE_EXIT_S = 30.0


class TransferQueueFull(RuntimeError):
    """The decode's worker has its bound of chunks waiting: the room fails instead of blocking."""


class Ready(Protocol):
    """What a chunk's pages wait for: the event recorded after the forward that wrote them
    (common/engine/kv_ready.py; a torch.cuda.Event on CUDA)."""

    def synchronize(self) -> None: ...


@dataclass
class Chunk:
    room: PrefillRoomState
    src_pages: list[int]
    dst_pages: list[int]
    aux: bytes | None  # set on the last chunk: the record written after the pages
    ready: Ready | None = None  # recorded after the forward that wrote the pages: waited on before reading them


Write = Callable[[Chunk], None]  # raises on failure; the exception's `cause` attribute, if any, names it
Notify = Callable[[PrefillRoomState, bool, str], None]  # (room, ok, reason): send the room's final status
MarkFailed = Callable[
    [PrefillRoomState, str, str], bool
]  # (room, reason, cause): fail a room and count it; False if it had already ended


class TransferWorker:
    def __init__(
        self,
        decode_id: str,
        write: Write,
        notify: Notify,
        mark_failed: MarkFailed,
        max_chunks: int,
        threaded: bool = True,
    ):
        self.decode_id = decode_id
        self.write, self.notify, self.mark_failed = write, notify, mark_failed
        self.max_chunks = max_chunks
        self.chunks: deque[Chunk] = deque()
        self.owed: list[PrefillRoomState] = []  # failed rooms whose decode still waits for the word
        self.cond = threading.Condition()
        self.retired = False
        self.died: BaseException | None = None
        self.current: Chunk | None = None
        if threaded:
            threading.Thread(target=self._loop, name=f"kv-transfer-{decode_id[-6:]}", daemon=True).start()

    @property
    def usable(self) -> bool:
        return not self.retired and self.died is None

    # -- called by the scheduler and control threads ----------------------------------------------
    def submit(self, chunk: Chunk) -> bool:
        """Queue a chunk; False if this worker retired or died (ask the pool again). Raises
        TransferQueueFull when `max_chunks` already wait."""
        with self.cond:
            if not self.usable:
                return False
            if len(self.chunks) >= self.max_chunks:
                raise TransferQueueFull(
                    f"{self.max_chunks} chunks already wait to be written to decode {self.decode_id}"
                )
            self.chunks.append(chunk)
            self.cond.notify()
            return True

    def owe_failure(self, room: PrefillRoomState) -> bool:
        """`room` failed: tell its decode once no write of it is in flight. False if this worker retired
        or died (ask the pool again)."""
        with self.cond:
            if not self.usable:
                return False
            self.owed.append(room)
            self.cond.notify()
            return True

    # -- the worker --------------------------------------------------------------------------------
    def run_once(self, wait_s: float = 0.0) -> bool:
        """Send the statuses owed, then run one merged chunk; False when there was nothing to do."""
        owed, chunk = self._take(wait_s)
        for room in owed:
            self.notify(room, False, room.poll.reason or "failed")
        if chunk is not None:
            self._run(chunk)
        return bool(owed) or chunk is not None

    def _take(self, wait_s: float) -> tuple[list[PrefillRoomState], Chunk | None]:
        with self.cond:
            if not self.owed and not self.chunks and wait_s > 0:
                self.cond.wait(wait_s)
            owed, self.owed = self.owed, []
            chunk = self._merge_queued() if self.chunks else None
            self.current = chunk
            return owed, chunk

    def _merge_queued(self) -> Chunk:
        """Chunks of one room that queued up while the previous copy ran go out as one batch, so runs
        that continue across chunk boundaries become single pieces."""
        chunk = self.chunks.popleft()
        while chunk.aux is None and self.chunks and self.chunks[0].room is chunk.room:
            nxt = self.chunks.popleft()
            merged = (chunk.src_pages + nxt.src_pages, chunk.dst_pages + nxt.dst_pages)
            chunk = Chunk(chunk.room, *merged, nxt.aux, nxt.ready or chunk.ready)  # events complete in order
        return chunk

    def _run(self, c: Chunk) -> None:
        if not c.room.poll.done:  # a failed or aborted room's chunks are dropped; its status is owed
            try:
                self.write(c)
            except Exception as e:
                log.warning("room %d: transfer to %s failed: %s", c.room.room_id, self.decode_id, e)
                if self.mark_failed(c.room, f"transfer error: {e}", getattr(e, "cause", "transfer_error")):
                    self.notify(c.room, False, f"transfer error: {e}")
            else:
                if c.aux is not None:
                    self.notify(c.room, True, "")
        self.current = None  # not in a finally: a thread dying here leaves it for _die to fail

    def _loop(self) -> None:
        lower_this_thread()  # the copies yield the cores to the threads on a first token's path
        try:
            while not self.retired:
                if not self.run_once(wait_s=IDLE_EXIT_S) and self._retire_if_idle():
                    return
        except BaseException as e:  # a bug: fail what this worker holds, say why, and let the pool replace it
            self._die(e)

    def _retire_if_idle(self) -> bool:
        with self.cond:
            if self.chunks or self.owed:
                return False
            self.retired = True
            return True

    def _die(self, e: BaseException) -> None:
        log.error("transfer thread for decode %s died: %r; failing its rooms", self.decode_id, e, exc_info=e)
        with self.cond:
            self.died = e
            rooms = {id(c.room): c.room for c in [*([self.current] if self.current else []), *self.chunks]}
            owed, self.owed, self.chunks = self.owed, [], deque()
        failed_here = [
            r
            for r in rooms.values()
            if self.mark_failed(r, f"the transfer thread for decode {self.decode_id} died: {e!r}", "worker_died")
        ]
        for room in [*owed, *failed_here]:
            try:
                self.notify(room, False, room.poll.reason or "failed")
            except Exception:
                log.exception("room %d: could not send its failure status", room.room_id)


class WorkerPool:
    """The live worker of each decode; a retired or dead one is replaced on demand."""

    def __init__(self, make: Callable[[str], TransferWorker]):
        self.make = make
        self.workers: dict[str, TransferWorker] = {}
        self.lock = threading.Lock()

    def get(self, decode_id: str) -> TransferWorker:
        with self.lock:
            worker = self.workers.get(decode_id)
            if worker is None or not worker.usable:
                worker = self.workers[decode_id] = self.make(decode_id)
            return worker

    def submit(self, decode_id: str, chunk: Chunk) -> None:
        """Queue on the decode's live worker (TransferQueueFull when its queue is full)."""
        while not self.get(decode_id).submit(chunk):
            pass  # it retired or died between get() and submit(): the next get() makes a new one

    def owe_failure(self, decode_id: str, room: PrefillRoomState) -> None:
        while not self.get(decode_id).owe_failure(room):
            pass

    def alive(self) -> list[TransferWorker]:
        with self.lock:
            return [w for w in self.workers.values() if w.usable]
