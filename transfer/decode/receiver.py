"""Decode side of one room: claims the room, sends the page indices to the prefill, waits for its status.

`pages_reusable(now)` says when the reserved pages may be reused (see transfer/decode/decode_rooms.py).
"""

from __future__ import annotations

from transfer.decode.decode_manager import DecodeKVManager
from transfer.messages import Abort, RoomRequest
from transfer.poll import KVPoll, Mark, no_mark


class KVReceiver:
    def __init__(
        self, manager: DecodeKVManager, room_id: int, prefill_endpoint: str, prefill_id: str, mark: Mark = no_mark
    ):
        """Raises DuplicateRoom if another request of this server waits on room `room_id`; `mark` records the
        room's steps on the request's timeline."""
        self.manager = manager
        self.room_id = room_id
        self.prefill_endpoint = prefill_endpoint
        self.prefill_id = prefill_id
        self.room = manager.claim(room_id, prefill_endpoint, prefill_id, mark)
        self.deadline: float | None = None
        self.abort_sent = False

    def init(
        self, dst_pages: list[int], aux_slot: int, cached_prefix_len: int = 0, dp_rank: int = 0, lora: str = ""
    ) -> bool:
        """Ask the prefill to write the prompt's pages from token `cached_prefix_len` (page-aligned: the
        decode's prefix cache holds the ones before) into `dst_pages` (of DP rank `dp_rank`'s pool under DP
        attention), computed under the LoRA adapter `lora` ("": the base model); False, sending nothing, if the room
        already failed (its prefill was declared dead while the request waited for memory): the caller
        fails the request."""
        if self.room.poll.state == KVPoll.Failed:
            return False
        m = self.manager
        m.register_with(self.prefill_endpoint, self.prefill_id)
        self.room.mark("room_request_sent")  # before the send: the prefill may mark its receipt before send() returns
        m.send(
            self.prefill_endpoint,
            RoomRequest(self.room_id, m.instance_id, dst_pages, aux_slot, cached_prefix_len, dp_rank, lora),
        )
        self.room.dst_pages = dst_pages
        self.room.requested, self.room.requested_at = True, m.clock()
        self.room.poll.advance(KVPoll.WaitingForInput)
        self.deadline = m.clock() + m.args.kv_wait_timeout_s
        return True

    def poll(self) -> KVPoll:
        s = self.room.poll
        if not s.done and self.deadline is not None and self.manager.clock() > self.deadline:
            self.manager.mark_failed(
                self.room, f"no KV arrived within {self.manager.args.kv_wait_timeout_s:g} s", "timeout"
            )
        return s.state

    @property
    def first_record(self) -> bytes | None:
        """The aux record the prefill sent ahead of the KV, once it arrived (None before, or if it was lost)."""
        return self.room.first_record

    @property
    def failure_reason(self) -> str | None:
        return self.room.poll.reason

    @property
    def writes_settled(self) -> bool:
        """The prefill will write nothing more (it never was asked, or its final status arrived)."""
        return not self.room.requested or self.room.status_received

    def pages_reusable(self) -> bool:
        return self.room.pages_reusable(self.manager.clock(), self.manager.args.heartbeat_interval_s)

    def abort(self, reason: str) -> None:
        """Stop waiting; ask the prefill to stop writing (it confirms with a status)."""
        self.manager.mark_failed(self.room, reason, "aborted")
        if not (self.writes_settled or self.abort_sent or self.room.prefill_dead_at is not None):
            self.abort_sent = True
            self.manager.send(self.prefill_endpoint, Abort(self.room_id, self.manager.instance_id, reason))

    def release(self) -> None:
        self.manager.forget(self.room)
