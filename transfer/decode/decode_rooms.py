"""The decode's table of rooms: one entry per request waiting for a prefill's KV (or, quarantined, for the
last write that may still land).

When may a room's pages be reused? Only when no write of the prefill can land in them any more:

    the room never asked the prefill for anything           -> at once
    the prefill's final status arrived (it follows the last write of the room)   -> at once
    the prefill was declared dead (it stopped answering pings; this decode stopped pinging it)
                                                             -> one heartbeat interval + CLOCK_SLACK_S later,
                                                                when the prefill's write fence has closed
    none of these within --transfer-timeout-s               -> then, with a warning
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from transfer.liveness import CLOCK_SLACK_S
from transfer.poll import DuplicateRoom, Mark, PollState, no_mark


@dataclass(eq=False)
class DecodeRoomState:
    room_id: int
    prefill_endpoint: str  # the prefill's control endpoint
    prefill_id: str  # the prefill's instance id: the only sender whose status this room accepts
    poll: PollState = field(default_factory=PollState)
    requested: bool = False  # the prefill was told where to write
    requested_at: float | None = None  # when (the manager's clock), for the room's latency
    status_received: bool = False  # the prefill's final word arrived; nothing more will land
    prefill_dead_at: float | None = None  # when the prefill was declared dead while this room waited on it
    first_record: bytes | None = None  # the aux record sent ahead of the KV (FirstToken), if it came
    dst_pages: list[int] = field(default_factory=list)  # where the prefill writes (what a checksum covers)
    check: Any = None  # its PageCheck (transfer/checksum.py), from the first checksums that came
    mark: Mark = no_mark  # the request's timeline

    def pages_reusable(self, now: float, interval_s: float) -> bool:
        if not self.requested or self.status_received:
            return True
        return self.prefill_dead_at is not None and now >= self.prefill_dead_at + interval_s + CLOCK_SLACK_S


class DecodeRoomTable:
    def __init__(self) -> None:
        self.rooms: dict[int, DecodeRoomState] = {}
        self.lock = threading.Lock()

    def claim(self, room_id: int, prefill_endpoint: str, prefill_id: str) -> DecodeRoomState:
        with self.lock:
            if room_id in self.rooms:
                raise DuplicateRoom(f"bootstrap_room {room_id} is already in use on this decode server")
            state = self.rooms[room_id] = DecodeRoomState(room_id, prefill_endpoint, prefill_id)
            return state

    def get(self, room_id: int) -> DecodeRoomState | None:
        with self.lock:
            return self.rooms.get(room_id)

    def forget(self, room: DecodeRoomState) -> None:
        with self.lock:
            if self.rooms.get(room.room_id) is room:
                del self.rooms[room.room_id]

    def snapshot(self) -> list[DecodeRoomState]:
        with self.lock:
            return list(self.rooms.values())
