"""Decode side of one room: registers with the prefill once, sends page indices, waits for status."""
from __future__ import annotations

import time

from transfer.manager import KVManager
from transfer.messages import Abort, Register, Request
from transfer.poll import KVPoll


class KVReceiver:
    def __init__(self, manager: KVManager, room: int, prefill_endpoint: str, prefill_id: str):
        self.manager = manager
        self.room_id = room
        self.endpoint = prefill_endpoint
        self.prefill_id = prefill_id
        self.state = manager.room(room)
        self.deadline: float | None = None

    def init(self, dst_pages: list[int], aux_slot: int) -> None:
        m = self.manager
        if self.endpoint not in m.registered_with:
            a = m.args
            m.send(self.endpoint, Register(
                m.instance_id, m.endpoint, m.backend.address(), a.kv_ptrs, a.bytes_per_page,
                a.num_pages, a.page_size, a.aux_ptr, a.aux_record_bytes, a.aux_slots,
            ))
            m.registered_with.add(self.endpoint)
        m.send(self.endpoint, Request(self.room_id, m.instance_id, dst_pages, aux_slot))
        self.state.poll.advance(KVPoll.WaitingForInput)
        self.deadline = time.monotonic() + m.args.kv_wait_timeout_s

    def poll(self) -> KVPoll:
        s = self.state.poll
        if not s.done and self.deadline is not None and time.monotonic() > self.deadline:
            s.fail(f"no KV arrived within {self.manager.args.kv_wait_timeout_s:.0f} s")
        return s.state

    @property
    def failure_reason(self) -> str | None:
        return self.state.poll.reason

    def abort(self, reason: str) -> None:
        if self.state.poll.fail(reason):
            self.manager.send(self.endpoint, Abort(self.room_id, reason))

    def release(self) -> None:
        self.manager.forget(self.room_id)
