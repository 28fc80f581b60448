"""Prefill side of the control plane: learns decode peers (refusing one whose registered layout differs
from ours), records their per-room requests, answers pings and aborts, and hands chunks to one
TransferWorker per decode.

Who sends a room's status: always that decode's worker (ok after the last write, failed once no write of
the room is in flight), except for a room this process never started writing, which is answered at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from common.wire.kv_heads import describe_sources, head_sources
from transfer.checksum import page_run_sums
from transfer.manager import KVArgs, KVManager
from transfer.messages import (
    Abort,
    BadMessage,
    Envelope,
    FirstToken,
    KVChecksums,
    Ping,
    Pong,
    RankWritten,
    Register,
    RoomRequest,
    Status,
)
from transfer.poll import DuplicateRoom, KVPoll, Mark, no_mark
from transfer.prefill.kv_writer import KVWriter, attention_tp, rank_peer, registration_problem
from transfer.prefill.prefill_rooms import PrefillRoomState, PrefillRoomTable
from transfer.prefill.rank_links import Agent, RankLinks
from transfer.prefill.transfer_worker import Chunk, TransferWorker, WorkerPool

log = logging.getLogger(__name__)
MAX_REFUSED_REMEMBERED = 1024


class FencedError(RuntimeError):
    """Writing into this decode's memory is no longer safe (see transfer/liveness.py)."""

    cause = "fenced"  # the room's failure cause (transfer/metrics.py), read by the transfer worker


class PrefillKVManager(KVManager):
    mode = "prefill"

    def __init__(self, args: KVArgs, rank_fault: Callable[[], str | None] = lambda: None, **kwargs):
        """`rank_fault()`: why the TP group is broken, or None (common.ranks.ranks: its followers'
        agents then answer nothing, and what waits on them fails at once)."""
        super().__init__(args, **kwargs)
        self.links = self._rank_links(rank_fault)
        self.writer = KVWriter(self.backend, args, self.links)
        self.metrics.rank_bytes = self.writer.rank_bytes
        self.registrations: dict[str, Register] = {}  # decode instances that registered and fit our layout
        self.refused: dict[str, tuple[Register, str]] = {}  # decode instances whose layout does not fit, and why
        self.table = PrefillRoomTable(self.clock)
        self.workers = WorkerPool(self._make_worker)
        self.hasher = ThreadPoolExecutor(2, "kv-checksum")  # --...-kv-checksum; no thread until first used
        self.start()

    def _rank_links(self, fault: Callable[[], str | None]) -> RankLinks | None:
        """The followers' agents (transfer.rank_agent), one per rank 1..tp_size-1; None at TP 1."""
        a = self.args
        if a.tp_size == 1:
            return None
        if len(a.rank_agents) != a.tp_size - 1:
            raise ValueError(f"a prefill at tp_size {a.tp_size} needs its followers' agents, got {len(a.rank_agents)}")
        agents = [Agent(rank, *agent) for rank, agent in enumerate(a.rank_agents, start=1)]
        return RankLinks(agents, self.send, self.endpoint, a.transfer_timeout_s, fault)

    def _make_worker(self, decode_id: str) -> TransferWorker:
        return TransferWorker(
            decode_id, self._write, self._notify, self.mark_failed, self.args.max_queued_chunks, self.threaded
        )

    # -- messages ------------------------------------------------------------------------------
    def handle(self, msg: object, envelope: Envelope) -> None:
        if isinstance(msg, RankWritten) and self.links is not None:
            return self.links.on_reply(msg, envelope)
        if not isinstance(msg, (Register, RoomRequest, Abort, Ping)):
            raise BadMessage(f"{type(msg).__name__} is not for a prefill server")
        if msg.decode_id != envelope.sender:
            raise BadMessage(f"{type(msg).__name__} names decode {msg.decode_id} but was sent by {envelope.sender}")
        if isinstance(msg, Register):
            return self._on_register(msg, envelope)
        registration = self._registration(msg)
        self.liveness.seen(msg.decode_id, envelope.sent_at)
        if isinstance(msg, Ping):
            self.send(registration.status_endpoint, Pong(self.endpoint))
        elif isinstance(msg, RoomRequest):
            self._on_request(msg, registration)
        else:
            self._on_abort(msg, registration)

    def _on_register(self, msg: Register, envelope: Envelope) -> None:
        problem = registration_problem(self.args, msg)
        if problem is not None:
            self.counters["peers_refused"] += 1
            self.refused[msg.decode_id] = (msg, problem)
            while len(self.refused) > MAX_REFUSED_REMEMBERED:
                self.refused.pop(next(iter(self.refused)))
            log.warning("refusing decode %s: %s", msg.decode_id, problem)
            return
        if msg.decode_id in self.registrations:
            # it declared this prefill dead: it will reuse the pages of its rooms here. What the old socket still queues is stale, and after a partition its TCP connection may sit in
            # retransmission backoff for seconds: what follows (these statuses, pongs) goes over a fresh one
            self.control.drop(self.registrations[msg.decode_id].status_endpoint)
            self._fail_rooms_of(
                msg.decode_id, f"decode {msg.decode_id} registered again: it gave up on its rooms here", "peer_dead"
            )
        for rank, address in enumerate(msg.backend_addresses):  # our followers' agents learn them on first use
            self.backend.add_peer(rank_peer(msg.decode_id, rank), address, msg.device_indices[rank])
        a = self.args
        if (msg.tp_size, msg.dp_size) != (a.tp_size, a.dp_size):
            plan = head_sources(a.kv_heads, attention_tp(a.tp_size, a.dp_size), attention_tp(msg.tp_size, msg.dp_size))
            log.info(
                "decode %s at TP %d, DP %d (we are at TP %d, DP %d): per attention group, %s",
                msg.decode_id,
                msg.tp_size,
                msg.dp_size,
                a.tp_size,
                a.dp_size,
                describe_sources(plan),
            )
        self.registrations[msg.decode_id] = msg
        self.refused.pop(msg.decode_id, None)
        self.liveness.seen(msg.decode_id, envelope.sent_at)

    def _registration(self, msg: RoomRequest | Abort | Ping) -> Register:
        registration = self.registrations.get(msg.decode_id)
        if registration is not None:
            return registration
        refused = self.refused.get(msg.decode_id)
        if refused is not None and isinstance(msg, RoomRequest):  # tell it why, then count the refusal
            self.send(
                refused[0].status_endpoint,
                Status(msg.room_id, False, f"prefill refused this decode's KV layout: {refused[1]}"),
            )
            self.metrics.failed("refused_layout")
        raise BadMessage(f"{type(msg).__name__} from unregistered decode {msg.decode_id}")

    def _on_request(self, msg: RoomRequest, registration: Register) -> None:
        if (
            any(not 1 <= p <= registration.num_pages for p in msg.dst_pages)
            or not 0 <= msg.aux_slot < registration.aux_slots
            or not 0 <= msg.dp_rank < registration.dp_size
        ):
            raise BadMessage(f"room {msg.room_id}: destination page, aux slot or DP rank outside the decode's pool")
        try:
            room, gave_up = self.table.on_request(msg)
        except ValueError as e:
            self.send(registration.status_endpoint, Status(msg.room_id, False, str(e)))
            self.metrics.failed("duplicate")
            raise BadMessage(str(e)) from None
        reason = gave_up or (room.poll.reason if room is not None else None)
        if reason is not None:  # this prefill already gave up on the room: say so now, not after a timeout
            self.send(registration.status_endpoint, Status(msg.room_id, False, reason))

    def _on_abort(self, msg: Abort, registration: Register) -> None:
        room = self.table.get(msg.room_id)
        if room is not None and room.room_request is not None and room.room_request.decode_id != msg.decode_id:
            raise BadMessage(f"abort of room {msg.room_id} from a decode that does not own it")
        if room is None and self.table.gave_up(msg.room_id):
            return  # failed and forgotten here: its worker sends the status after the room's last write
        if room is None or self.table.drop_unowned(msg.room_id):  # nothing was ever written for it
            self.send(registration.status_endpoint, Status(msg.room_id, False, f"aborted by decode: {msg.reason}"))
        else:
            self.fail_room(room, f"decode aborted: {msg.reason}", "peer_aborted")

    # -- rooms (called by KVSender on the scheduler thread) ------------------------------------
    @property
    def rooms(self) -> dict[int, PrefillRoomState]:
        """The room table by room id (read-only use)."""
        return self.table.rooms

    def claim(self, room_id: int, mark: Mark = no_mark) -> PrefillRoomState:
        """The room for a local request (its timeline: `mark`); DuplicateRoom if another request holds it."""
        try:
            return self.table.claim(room_id, mark)
        except DuplicateRoom:
            self.metrics.failed("duplicate")
            raise

    def forget(self, room: PrefillRoomState) -> None:
        self.table.forget(room)

    def fail_room(self, room: PrefillRoomState, reason: str, cause: str) -> None:
        """Fail the room (`cause`: one of transfer.metrics.CAUSES); if a decode waits on it, its worker
        tells it once no write is in flight."""
        if self.mark_failed(room, reason, cause) and room.room_request is not None:
            self.workers.owe_failure(room.room_request.decode_id, room)

    def announce_first_token(self, room: PrefillRoomState, record: bytes) -> None:
        """Send the room's aux record to its decode now, ahead of the KV that carries it too: the decode
        streams the first token without waiting for the write."""
        registration = self.registrations.get(room.room_request.decode_id)
        if registration is not None:  # marked first: the decode may commit the token before send() returns
            room.mark("first_token_sent")
            self.send(registration.status_endpoint, FirstToken(room.room_id, record))

    def enqueue(self, chunk: Chunk) -> None:
        """Hand a chunk to its decode's worker (TransferQueueFull when that queue is full)."""
        if chunk.room.first_chunk_at is None:
            chunk.room.first_chunk_at = self.clock()
        self.workers.submit(chunk.room.room_request.decode_id, chunk)

    # -- data plane (on a worker) --------------------------------------------------------------
    def _write(self, chunk: Chunk) -> None:
        room_request = chunk.room.room_request
        registration = self.registrations.get(room_request.decode_id)
        if registration is None:
            raise FencedError(f"decode {room_request.decode_id} is no longer registered")
        fence = lambda: self._fence(room_request.decode_id, chunk.room)  # noqa: E731
        if chunk.ready is not None:  # the forward that wrote the pages may still run on the device
            chunk.ready.synchronize()
        a = self.args
        sums = None  # the source pages change no more: hashed while they are written (xxhash lets go of the GIL)
        if a.kv_checksum:
            sums = self.hasher.submit(page_run_sums, a.kv_ptrs, a.bytes_per_page, chunk.src_pages, chunk.dst_pages)
        start = time.perf_counter()
        written = self.writer.write(
            registration,
            room_request,
            chunk.src_pages,
            chunk.dst_pages,
            chunk.aux,
            fence,
            chunk.room.mark,
            chunk.room.dp_rank,
        )
        self.counters["write_microseconds"] += int(1e6 * (time.perf_counter() - start))
        if sums is not None and chunk.aux is None:  # landed: the decode checks these pages now
            self.send(registration.status_endpoint, KVChecksums(chunk.room.room_id, sums.result()))
        elif sums is not None:  # the last chunk's go with the final status
            chunk.room.checksums = sums.result()
        self.counters["chunks_sent"] += 1
        self.counters["bytes_sent"] += written

    def _fence(self, decode_id: str, room: PrefillRoomState) -> None:
        problem = self.liveness.may_write_to(decode_id)
        if problem is None and room.poll.state == KVPoll.Failed:
            problem = f"room {room.room_id} failed: {room.poll.reason}"
        if problem is not None:
            self.counters["writes_fenced"] += 1
            raise FencedError(f"not writing: {problem}")

    def _notify(self, room: PrefillRoomState, ok: bool, reason: str) -> None:
        if ok and not room.poll.advance(KVPoll.Success):
            return  # failed while its last write ran: the failure is owed and follows
        if ok:
            self.counters["rooms_succeeded"] += 1
            self.metrics.latency.observe(self.clock() - room.first_chunk_at)
        registration = self.registrations.get(room.room_request.decode_id)
        if registration is not None:  # marked first, as first_token_sent
            room.mark("status_sent")
            self.send(registration.status_endpoint, Status(room.room_id, ok, reason, room.checksums if ok else []))
        self.wake_scheduler()  # the request ends now, not at the scheduler's next timeout

    def close(self) -> None:
        super().close()
        self.writer.close()
        self.hasher.shutdown(wait=False, cancel_futures=True)

    # -- heartbeat -----------------------------------------------------------------------------
    def watched_peers(self) -> list[str]:
        rooms = self.table.snapshot()
        return list(
            dict.fromkeys(r.room_request.decode_id for r in rooms if r.owned and r.room_request and not r.poll.done)
        )

    def declare_dead(self, peer: str, silent_s: float) -> None:
        reason = f"decode {peer} sent no heartbeat for {silent_s:.1f} s (dead or frozen)"
        log.warning("%s: failing its rooms", reason)
        self._fail_rooms_of(peer, reason, "peer_dead")

    def _fail_rooms_of(self, decode_id: str, reason: str, cause: str) -> None:
        for room in self.table.snapshot():
            if room.owned and room.room_request is not None and room.room_request.decode_id == decode_id:
                self.fail_room(room, reason, cause)
