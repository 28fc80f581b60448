"""Prefill side of the control plane: learns decode peers, accepts their per-room requests, answers
pings and aborts, and runs one TransferWorker per decode.

Who sends a room's status: always that decode's TransferWorker (ok after the last write, failed after
any write in flight), except for a room this process never started writing, which is answered at once.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from transfer.manager import KVArgs, KVManager, RoomState
from transfer.messages import Abort, BadMessage, Ping, Pong, Register, Request, Status
from transfer.runs import chunk_triples
from transfer.transfer_worker import Chunk, FailureNotice, TransferWorker

log = logging.getLogger(__name__)
ORPHAN_TTL_S = 600.0  # a decode's request for a room whose HTTP request never reached this prefill


class AuxStaging:
    """Registered host memory that aux records are written from: one slot per write in flight, so
    workers of different decodes never share a buffer."""

    def __init__(self, backend, slots: int = 64, slot_bytes: int = 4096):
        self.slot_bytes = slot_bytes
        self.buffer = (ctypes.c_uint8 * (slots * slot_bytes))()
        backend.register(ctypes.addressof(self.buffer), len(self.buffer))
        self._free = list(range(slots))
        self._available = threading.Semaphore(slots)
        self._lock = threading.Lock()

    @contextmanager
    def slot(self, record: bytes) -> Iterator[int]:
        """The address of a slot holding `record`, for the duration of one write."""
        if len(record) > self.slot_bytes:
            raise ValueError(f"aux record of {len(record)} bytes exceeds the {self.slot_bytes}-byte staging slot")
        self._available.acquire()
        with self._lock:
            index = self._free.pop()
        try:
            addr = ctypes.addressof(self.buffer) + index * self.slot_bytes
            ctypes.memmove(addr, record, len(record))
            yield addr
        finally:
            with self._lock:
                self._free.append(index)
            self._available.release()


class PrefillKVManager(KVManager):
    mode = "prefill"

    def __init__(self, args: KVArgs):
        super().__init__(args)
        self.aux_staging = AuxStaging(self.backend)
        self.peers: dict[str, Register] = {}  # decode instances that registered
        self.workers: dict[str, TransferWorker] = {}
        self.tombstones: dict[int, tuple[str, float]] = {}  # failed rooms already forgotten: reason, when
        self._next_expiry = 0.0

    # -- messages ------------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        if isinstance(msg, Register):
            self.backend.add_peer(msg.decode_id, msg.backend_address)
            self.peers[msg.decode_id] = msg
            self.liveness.seen(msg.decode_id)
            return
        if not isinstance(msg, (Request, Abort, Ping)):
            raise BadMessage(f"{type(msg).__name__} is not for a prefill server")
        peer = self.peers.get(msg.decode_id)
        if peer is None:
            raise BadMessage(f"{type(msg).__name__} from unregistered decode {msg.decode_id}")
        self.liveness.seen(msg.decode_id)
        if isinstance(msg, Ping):
            self.send(peer.status_endpoint, Pong(self.endpoint))
        elif isinstance(msg, Request):
            self._on_request(msg, peer)
        else:
            self._on_abort(msg, peer)

    def _on_request(self, req: Request, peer: Register) -> None:
        if any(not 1 <= p <= peer.num_pages for p in req.dst_pages) or not 0 <= req.aux_slot < peer.aux_slots:
            raise BadMessage(f"room {req.room}: destination page or aux slot outside the decode's pool")
        self._expire_orphans()
        with self._lock:
            tomb = self.tombstones.get(req.room)
            room = None if tomb else self.rooms.setdefault(req.room, RoomState())
            if room is not None and room.request is not None:
                raise BadMessage(f"room {req.room} was requested twice")
            if room is not None:
                room.request = req
        # this prefill already gave up on the room (forgotten or not): say so now, not after a timeout
        reason = tomb[0] if tomb else room.poll.reason
        if reason is not None:
            self.send(peer.status_endpoint, Status(req.room, False, reason))

    def _on_abort(self, msg: Abort, peer: Register) -> None:
        with self._lock:
            room = self.rooms.get(msg.room)
            if room is not None and room.request is not None and room.request.decode_id != msg.decode_id:
                raise BadMessage(f"abort of room {msg.room} from a decode that does not own it")
            if room is not None and not room.owned:
                del self.rooms[msg.room]  # nothing was ever written for it
                room = None
        if room is None:
            self.send(peer.status_endpoint, Status(msg.room, False, f"aborted by decode: {msg.reason}"))
        else:
            self.fail_room(msg.room, room, f"decode aborted: {msg.reason}")

    def _expire_orphans(self) -> None:
        now = time.monotonic()
        if now < self._next_expiry:  # a sweep is O(rooms): at most one a second
            return
        self._next_expiry = now + 1.0
        with self._lock:
            for r, st in list(self.rooms.items()):
                if not st.owned and now - st.created > ORPHAN_TTL_S:
                    del self.rooms[r]
            for r, (_, when) in list(self.tombstones.items()):
                if now - when > ORPHAN_TTL_S:
                    del self.tombstones[r]

    def forget(self, room: int) -> None:
        """Drop the room; a failed one leaves a tombstone so a late request for it is answered."""
        with self._lock:
            state = self.rooms.pop(room, None)
            if state is not None and state.poll.reason is not None:
                self.tombstones[room] = (state.poll.reason, time.monotonic())

    # -- rooms ---------------------------------------------------------------------------------
    def fail_room(self, room_id: int, state: RoomState, reason: str) -> None:
        """Fail the room; if a decode waits on it, its worker tells it after any write in flight."""
        if state.poll.fail(reason):
            self.counters["rooms_failed"] += 1
            if state.request is not None:
                self.enqueue(FailureNotice(room_id, state))

    def enqueue(self, item: Chunk | FailureNotice) -> None:
        decode_id = item.state.request.decode_id
        with self._lock:
            worker = self.workers.get(decode_id)
            if worker is None or not worker.alive:
                worker = self.workers[decode_id] = TransferWorker(self, decode_id)
            worker.queue.put(item)

    def retire_worker_if_idle(self, worker: TransferWorker) -> bool:
        with self._lock:
            if not worker.queue.empty():
                return False
            worker.alive = False
            if self.workers.get(worker.decode_id) is worker:
                del self.workers[worker.decode_id]
            return True

    # -- data plane ----------------------------------------------------------------------------
    def write_chunk(self, req: Request, src_pages: list[int], dst_pages: list[int], aux: bytes | None) -> None:
        peer = self.peers[req.decode_id]
        a = self.args
        src, dst, nbytes = chunk_triples(a.kv_ptrs, peer.kv_ptrs, a.bytes_per_page, src_pages, dst_pages)
        self.backend.write_batch(req.decode_id, src, dst, nbytes, a.on_cuda)  # one batch: each backend splits as it must
        self.counters["bytes_sent"] += sum(nbytes)
        if aux is not None:
            if len(aux) != peer.aux_record_bytes:
                raise ValueError(f"aux record of {len(aux)} bytes, decode expects {peer.aux_record_bytes}")
            dst_aux = peer.aux_ptr + req.aux_slot * peer.aux_record_bytes
            with self.aux_staging.slot(aux) as src_aux:
                self.backend.write_batch(req.decode_id, [src_aux], [dst_aux], [len(aux)])

    def send_status(self, req: Request, status: Status) -> None:
        peer = self.peers.get(req.decode_id)
        if peer is not None:
            self.send(peer.status_endpoint, status)

    # -- heartbeat -----------------------------------------------------------------------------
    def watched_peers(self) -> set[str]:
        return {st.request.decode_id for _, st in self.rooms_snapshot() if st.owned and st.request and not st.poll.done}

    def declare_dead(self, peer: str, silent_s: float) -> None:
        reason = f"decode {peer} sent no heartbeat for {silent_s:.1f} s (dead or frozen)"
        log.warning("%s: failing its rooms", reason)
        for room_id, st in self.rooms_snapshot():
            if st.owned and st.request is not None and st.request.decode_id == peer:
                self.fail_room(room_id, st, reason)
