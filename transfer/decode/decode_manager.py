"""Decode side of the control plane: registers with each prefill it needs, accepts a room's status only
from the prefill that owns the room, pings the prefills its rooms wait on and fails those rooms when a
prefill falls silent."""

from __future__ import annotations

import logging
from collections.abc import Callable

from transfer.decode.decode_rooms import DecodeRoomState, DecodeRoomTable
from transfer.manager import KVArgs, KVManager
from transfer.messages import BadMessage, Envelope, FirstToken, Ping, Pong, Register, Status
from transfer.poll import DuplicateRoom, KVPoll, Mark, no_mark

log = logging.getLogger(__name__)


class DecodeKVManager(KVManager):
    mode = "decode"

    def __init__(self, args: KVArgs, **kwargs):
        super().__init__(args, **kwargs)
        self.backend.register(args.aux_ptr, args.aux_record_bytes * args.aux_slots)
        self.table = DecodeRoomTable()
        self.registered_with: dict[str, str] = {}  # prefill endpoint -> the instance there that knows where to write
        self.on_peer_dead: list[Callable[[str], None]] = []
        self.start()

    @property
    def rooms(self) -> dict[int, DecodeRoomState]:
        """The room table by room id (read-only use)."""
        return self.table.rooms

    def handle(self, msg: object, envelope: Envelope) -> None:
        if isinstance(msg, Status):
            self._on_status(msg, envelope)
        elif isinstance(msg, FirstToken):
            self._room_of(msg.room_id, envelope, "first token").first_record = msg.record
        elif isinstance(msg, Pong):
            self.liveness.seen(msg.endpoint, envelope.sent_at)
        else:
            raise BadMessage(f"{type(msg).__name__} is not for a decode server")

    def _room_of(self, room_id: int, envelope: Envelope, what: str) -> DecodeRoomState:
        """The room a prefill's message is about; BadMessage unless that prefill owns it."""
        room = self.table.get(room_id)
        if room is None:
            raise BadMessage(f"{what} for unknown room {room_id}")
        if envelope.sender != room.prefill_id:
            raise BadMessage(
                f"{what} for room {room_id} from {envelope.sender}, not from its prefill {room.prefill_id}"
            )
        return room

    def _on_status(self, msg: Status, envelope: Envelope) -> None:
        room = self._room_of(msg.room_id, envelope, "status")
        room.status_received = True
        room.mark("status_received")
        self.liveness.seen(room.prefill_endpoint, envelope.sent_at)
        if not msg.ok:
            self.mark_failed(room, msg.reason, "peer_failed")
        elif room.poll.advance(KVPoll.Success) and room.requested_at is not None:
            self.counters["rooms_succeeded"] += 1
            self.metrics.latency.observe(self.clock() - room.requested_at)

    # -- rooms (called by KVReceiver on the scheduler thread) ----------------------------------
    def claim(self, room_id: int, prefill_endpoint: str, prefill_id: str, mark: Mark = no_mark) -> DecodeRoomState:
        """A room waiting on prefill `prefill_id` at `prefill_endpoint` (its request's timeline: `mark`);
        DuplicateRoom if taken."""
        try:
            room = self.table.claim(room_id, prefill_endpoint, prefill_id)
        except DuplicateRoom:
            self.metrics.failed("duplicate")
            raise
        room.mark = mark
        return room

    def forget(self, room: DecodeRoomState) -> None:
        self.table.forget(room)

    def register_with(self, endpoint: str, prefill_id: str) -> None:
        """Tell a prefill where this decode's buffers are (once per prefill process: a prefill restarted at
        the same endpoint is a new instance and hears it again)."""
        if self.registered_with.get(endpoint) == prefill_id:
            return
        a = self.args
        self.send(
            endpoint,
            Register(
                self.instance_id,
                self.endpoint,
                [self.backend.address(), *a.rank_addresses],
                a.kv_ptrs,
                a.bytes_per_page,
                a.num_pages,
                a.page_size,
                a.aux_ptr,
                a.aux_record_bytes,
                a.aux_slots,
                a.tp_size,
                a.kv_heads,
                [a.device_index, *a.rank_device_indices],
            ),
        )
        self.registered_with[endpoint] = prefill_id

    # -- heartbeat -----------------------------------------------------------------------------
    def watched_peers(self) -> list[str]:
        """Prefills that may still write into a room of ours (also rooms already failed here), in the order
        of their rooms: the frames a heartbeat sends follow the rooms' order, not the hashes of peer ids."""
        rooms = self.table.snapshot()
        return list(
            dict.fromkeys(
                r.prefill_endpoint for r in rooms if r.requested and not r.status_received and r.prefill_dead_at is None
            )
        )

    def ping(self, peers: list[str]) -> None:
        for peer in peers:
            self.send(peer, Ping(self.instance_id))

    def declare_dead(self, peer: str, silent_s: float) -> None:
        """Fail the rooms waiting on `peer` and stop pinging it; their pages become reusable one interval
        later (DecodeRoomState.pages_reusable), once the prefill's write fence has closed."""
        reason = f"prefill {peer} answered no heartbeat for {silent_s:.1f} s (dead or frozen)"
        log.warning("%s: failing the rooms waiting on it", reason)
        now = self.clock()
        for room in self.table.snapshot():
            if room.prefill_endpoint == peer and not room.status_received:
                if room.requested:  # its pages come back once the prefill's write fence has closed
                    room.prefill_dead_at = now
                self.mark_failed(room, reason, "peer_dead")
        self.registered_with.pop(peer, None)
        self.control.drop(peer)
        for callback in self.on_peer_dead:
            callback(peer)
