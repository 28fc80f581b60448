"""Decode side of one room: sends the page indices to the prefill, waits for its status.

`writes_settled` says when the reserved pages may be reused: the prefill has sent its final status
(it sends it only after its last write of the room), or the room never asked it for anything.
"""
from __future__ import annotations

import time

from transfer.decode_manager import DecodeKVManager
from transfer.messages import Abort, Request
from transfer.poll import KVPoll


class KVReceiver:
    def __init__(self, manager: DecodeKVManager, room: int, prefill_endpoint: str, prefill_id: str):
        self.manager = manager
        self.room_id = room
        self.endpoint = prefill_endpoint
        self.prefill_id = prefill_id
        self.state = manager.claim(room)
        self.state.peer = prefill_endpoint
        self.deadline: float | None = None
        self.requested = False
        self.abort_sent = False

    def init(self, dst_pages: list[int], aux_slot: int) -> None:
        m = self.manager
        m.register_with(self.endpoint)
        m.send(self.endpoint, Request(self.room_id, m.instance_id, dst_pages, aux_slot))
        self.requested = True
        self.state.poll.advance(KVPoll.WaitingForInput)
        self.deadline = time.monotonic() + m.args.kv_wait_timeout_s

    def poll(self) -> KVPoll:
        s = self.state.poll
        if not s.done and self.deadline is not None and time.monotonic() > self.deadline:
            s.fail(f"no KV arrived within {self.manager.args.kv_wait_timeout_s:g} s")
        return s.state

    @property
    def failure_reason(self) -> str | None:
        return self.state.poll.reason

    @property
    def writes_settled(self) -> bool:
        return not self.requested or self.state.status_received

    def abort(self, reason: str) -> None:
        """Stop waiting; ask the prefill to stop writing (it confirms with a status)."""
        self.state.poll.fail(reason)
        if not (self.writes_settled or self.abort_sent or self.state.peer_dead):
            self.abort_sent = True
            self.manager.send(self.endpoint, Abort(self.room_id, self.manager.instance_id, reason))

    def release(self) -> None:
        self.manager.forget(self.room_id)
