"""Prefill side of one room: waits for the decode's page indices, then queues chunks and aux."""
from __future__ import annotations

from transfer.poll import KVPoll
from transfer.prefill_manager import PrefillKVManager
from transfer.transfer_worker import Chunk


class KVSender:
    def __init__(self, manager: PrefillKVManager, room: int):
        self.manager = manager
        self.room_id = room
        self.state = manager.claim(room)
        self.offset = 0  # destination pages used by earlier chunks

    def poll(self) -> KVPoll:
        if self.state.poll.state == KVPoll.Bootstrapping and self.state.request is not None:
            self.state.poll.advance(KVPoll.WaitingForInput)
        return self.state.poll.state

    @property
    def num_dst_pages(self) -> int:
        return len(self.state.request.dst_pages) if self.state.request else 0

    @property
    def failure_reason(self) -> str | None:
        return self.state.poll.reason

    def send(self, src_pages: list[int], is_last: bool, aux: bytes | None) -> None:
        """Queue one chunk; on the last one `aux` is the record written after the pages."""
        dst = self.state.request.dst_pages[self.offset : self.offset + len(src_pages)]
        if len(dst) != len(src_pages):
            self.abort(f"chunk of {len(src_pages)} pages overruns the {self.num_dst_pages} reserved by decode")
            return
        self.offset += len(src_pages)
        self.state.poll.advance(KVPoll.Transferring)
        self.manager.enqueue(Chunk(self.room_id, self.state, src_pages, dst, aux if is_last else None))

    def abort(self, reason: str) -> None:
        self.manager.fail_room(self.room_id, self.state, reason)

    def release(self) -> None:
        self.manager.forget(self.room_id)
