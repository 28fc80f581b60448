"""Prefill side of one room: claims the room, waits for the decode's page indices (for the prompt past
the prefix the decode has cached), then queues chunks and, with the last one, the aux record."""

from __future__ import annotations

from transfer.poll import KVPoll, Mark, no_mark
from transfer.prefill.prefill_manager import PrefillKVManager
from transfer.prefill.transfer_worker import Chunk, Ready, TransferQueueFull


class KVSender:
    def __init__(self, manager: PrefillKVManager, room_id: int, mark: Mark = no_mark, dp_rank: int = 0):
        """Raises DuplicateRoom if another request of this server holds room `room_id`; `mark` records the
        room's steps on the request's timeline; `dp_rank`: whose pool the pages are (DP attention)."""
        self.manager = manager
        self.room = manager.claim(room_id, mark)
        self.room.dp_rank = dp_rank
        self.offset = 0  # destination pages used by earlier chunks

    def poll(self) -> KVPoll:
        if self.room.poll.state == KVPoll.Pairing and self.room.room_request is not None:
            self.room.poll.advance(KVPoll.WaitingForInput)
        return self.room.poll.state

    @property
    def num_dst_pages(self) -> int:
        return len(self.room.room_request.dst_pages) if self.room.room_request else 0

    @property
    def cached_prefix_len(self) -> int:
        """Prompt tokens the decode has cached: the pages start after them."""
        return self.room.room_request.cached_prefix_len if self.room.room_request else 0

    @property
    def lora(self) -> str:
        """The LoRA adapter the decode runs the request under ("": the base model)."""
        return self.room.room_request.lora if self.room.room_request else ""

    @property
    def failure_reason(self) -> str | None:
        return self.room.poll.reason

    def send(self, src_pages: list[int], is_last: bool, aux: bytes | None, ready: Ready | None = None) -> None:
        """Queue one chunk; on the last one `aux` is the record written after the pages; `ready`: the event
        of the forward that wrote them (the write waits on it). A chunk that does not fit the decode's
        pages, or a full transfer queue, fails the room instead."""
        dst = self.room.room_request.dst_pages[self.offset : self.offset + len(src_pages)]
        if len(dst) != len(src_pages):
            self.abort(
                f"chunk of {len(src_pages)} pages overruns the {self.num_dst_pages} reserved by decode", "overrun"
            )
            return
        self.offset += len(src_pages)
        if is_last and aux is not None and self.room.poll.state != KVPoll.Failed:
            self.manager.announce_first_token(self.room, aux)  # first, so it goes out before the status can
        self.room.poll.advance(KVPoll.Transferring)
        self.room.mark("chunk_queued")
        try:
            self.manager.enqueue(Chunk(self.room, src_pages, dst, aux if is_last else None, ready))
        except TransferQueueFull as e:
            self.abort(str(e), "queue_full")

    def abort(self, reason: str, cause: str = "aborted") -> None:
        """Fail the room; `cause` is what transfer/metrics.py counts it as."""
        self.manager.fail_room(self.room, reason, cause)

    def release(self) -> None:
        self.manager.forget(self.room)
