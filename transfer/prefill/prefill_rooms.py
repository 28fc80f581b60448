"""The prefill's table of rooms: one entry per room a decode asked for or a local request claimed,
plus tombstones of rooms given up on, so a decode that asks late hears "failed" at once.

A room appears when the decode's request arrives (unowned: no HTTP request here yet) or when this
process's request claims it (owned), whichever comes first. A room id is the client's word (through the
router, a random 63-bit number): a second claim of a room that is still held, or that failed recently,
is refused (DuplicateRoom), so two requests can never share one decode's pages.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer.messages import RoomRequest
from transfer.poll import DuplicateRoom, Mark, PollState, no_mark

ORPHAN_TTL_S = 600.0  # a decode's request for a room whose HTTP request never reached this prefill
SWEEP_INTERVAL_S = 1.0


@dataclass(eq=False)
class PrefillRoomState:
    room_id: int
    created: float
    first_chunk_at: float | None = None  # when its first chunk was queued (the table's clock), for its latency
    poll: PollState = field(default_factory=PollState)
    room_request: RoomRequest | None = None  # where the decode wants the KV; None until it asked
    requested_at: float | None = None  # when the decode's request arrived (the clock of the table)
    owned: bool = False  # a KVSender of this process holds the room
    dp_rank: int = 0  # whose pool the room's pages are (DP attention: the prefill DP rank its request runs on)
    mark: Mark = no_mark  # the owning request's timeline
    checksums: list[list[int]] = field(default_factory=list)  # the last chunk's page runs (--...-kv-checksum)


class PrefillRoomTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.rooms: dict[int, PrefillRoomState] = {}
        self.tombstones: dict[int, tuple[str, float]] = {}  # failed rooms already forgotten: reason, when
        self.lock = threading.Lock()
        self._next_sweep = 0.0

    def claim(self, room_id: int, mark: Mark = no_mark) -> PrefillRoomState:
        """The room, now held by a local request whose timeline `mark` records the room's steps;
        DuplicateRoom if another request holds it."""
        with self.lock:
            state = self.rooms.get(room_id)
            if (state is not None and state.owned) or room_id in self.tombstones:
                raise DuplicateRoom(f"bootstrap_room {room_id} is already in use on this prefill server")
            if state is None:
                state = self.rooms[room_id] = PrefillRoomState(room_id, self.clock())
            state.owned, state.mark = True, mark
            if state.requested_at is not None:
                mark("room_request_received", state.requested_at)
            return state

    def on_request(self, msg: RoomRequest) -> tuple[PrefillRoomState | None, str | None]:
        """Record a decode's request: (room, None), or (None, reason) if this prefill already gave up on
        the room. Raises ValueError when another decode asked for the room first."""
        self.sweep()
        with self.lock:
            tomb = self.tombstones.get(msg.room_id)
            if tomb is not None:
                return None, tomb[0]
            state = self.rooms.setdefault(msg.room_id, PrefillRoomState(msg.room_id, self.clock()))
            if state.room_request is not None:
                raise ValueError(f"room {msg.room_id} was requested twice")
            state.room_request, state.requested_at = msg, self.clock()
            state.mark("room_request_received", state.requested_at)
            return state, None

    def get(self, room_id: int) -> PrefillRoomState | None:
        with self.lock:
            return self.rooms.get(room_id)

    def gave_up(self, room_id: int) -> bool:
        """The room failed here and was forgotten (a tombstone remains)."""
        with self.lock:
            return room_id in self.tombstones

    def drop_unowned(self, room_id: int) -> bool:
        """Forget a room no local request holds (nothing was ever written for it)."""
        with self.lock:
            state = self.rooms.get(room_id)
            if state is None or state.owned:
                return False
            del self.rooms[room_id]
            return True

    def forget(self, room: PrefillRoomState) -> None:
        """Drop the room; a failed one leaves a tombstone so a late request for it is answered."""
        with self.lock:
            if self.rooms.get(room.room_id) is room:
                del self.rooms[room.room_id]
                if room.poll.reason is not None:
                    self.tombstones[room.room_id] = (room.poll.reason, self.clock())

    def snapshot(self) -> list[PrefillRoomState]:
        with self.lock:
            return list(self.rooms.values())

    def sweep(self) -> None:
        """Expire orphans and old tombstones; a sweep is O(rooms), so at most one a second."""
        now = self.clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        with self.lock:
            for r, st in list(self.rooms.items()):
                if not st.owned and now - st.created > ORPHAN_TTL_S:
                    del self.rooms[r]
            for r, (_, when) in list(self.tombstones.items()):
                if now - when > ORPHAN_TTL_S:
                    del self.tombstones[r]
