"""Prefill role: a request waits until a decode has reserved pages for it, is prefilled (in chunks) by
the scheduler, streams each chunk's KV pages to the decode, sends the aux record with the last chunk,
and waits in `inflight` until the transfer is done; then its KV stays in the radix cache.

    awaiting_decode --(decode sent page ids)--> scheduler's prefill queue --(prompt computed)--> inflight --> done
       no row, no KV                           row + KV, chunks sent as computed                 row + KV until
                                                                                                  Success/Failed

A request with max_new_tokens 0 needs no decode: it is computed like a monolithic one, no room.

Who frees what: every exit goes through Scheduler.finish -> release() here (the sender is told to stop,
its room forgotten) -> MemoryManager.release (computed KV into the radix cache). A write already in
flight may still read those pages; that only sends stale bytes into the pages of a room that failed,
which the decode reuses only after this side's failure status, sent after that write.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from common.config import ServerConfig
from common.engine.request import FinishReason, Req, ReqStatus
from common.engine.role import Role, Sampled
from common.engine.scheduler import Scheduler
from common.memory.errors import MemoryIntegrityError
from transfer.aux_record import AuxRecord
from transfer.poll import DuplicateRoom, KVPoll
from transfer.prefill_manager import PrefillKVManager
from transfer.sender import KVSender

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Outbound:
    """One request's transfer: its sender and how many prompt tokens' pages it queued so far."""

    sender: KVSender
    sent_tokens: int = 0


class PrefillRole(Role):
    def __init__(self, scheduler: Scheduler, kv_manager: PrefillKVManager, config: ServerConfig):
        self.scheduler, self.kv_manager, self.config = scheduler, kv_manager, config
        self.instance_id = kv_manager.instance_id
        kv_manager.wake_scheduler = scheduler.wake
        self.awaiting_decode: list[Req] = []  # no decode has reserved pages for these yet
        self.inflight: list[Req] = []  # prompt computed, KV on its way
        self.outbound: dict[Req, Outbound] = {}

    # -- admission -----------------------------------------------------------------------------
    def admit(self, req: Req) -> bool:
        if req.rendezvous is None:
            self.scheduler.fail(req, "a prefill server needs bootstrap_room: send requests through the router", 400)
            return True
        if req.params.max_new_tokens == 0:
            return False  # nothing to hand over: computed here, answered here
        try:
            self.outbound[req] = Outbound(KVSender(self.kv_manager, req.rendezvous.room, req.timeline.mark))
        except DuplicateRoom as e:
            self.scheduler.fail(req, str(e), 409)
            return True
        req.status = ReqStatus.PAIRING
        self.awaiting_decode.append(req)
        return True

    def poll(self) -> None:
        for req in list(self.awaiting_decode):
            self.scheduler.guarded(req, "waiting for the decode", lambda: self._poll_awaiting(req))
        awaiting = set(self.awaiting_decode)
        for req in [r for r in self.outbound if r not in awaiting]:  # being computed, or its KV in flight
            self.scheduler.guarded(req, "sending its KV", lambda: self._poll_sending(req))

    def _poll_awaiting(self, req: Req) -> None:
        sender = self.outbound[req].sender
        state = sender.poll()
        if state == KVPoll.Failed:
            self.scheduler.fail(req, f"decode peer failed before the transfer: {sender.failure_reason}")
        elif state >= KVPoll.WaitingForInput:
            self._start_prefill(req, sender)
        elif self.scheduler.clock() - req.arrival_time > self.config.pairing_timeout_s:
            self.scheduler.fail(req, f"no decode server reserved memory for room {req.rendezvous.room} "
                                     f"within {self.config.pairing_timeout_s:g} s", 504)

    def _start_prefill(self, req: Req, sender: KVSender) -> None:
        need = -(-len(req.prompt_ids) // self.config.page_size)
        self.awaiting_decode.remove(req)
        if sender.num_dst_pages != need:
            self.scheduler.fail(req, f"decode reserved {sender.num_dst_pages} pages, the prompt needs {need}", 500)
            return
        req.status = ReqStatus.WAITING
        self.scheduler.prefill.add(req)

    def _poll_sending(self, req: Req) -> None:
        """A room that failed ends its request at once, also one whose prompt is still being computed (its
        remaining chunks would go nowhere)."""
        sender = self.outbound[req].sender
        state = sender.poll()
        if state == KVPoll.Failed:
            self.scheduler.fail(req, f"KV transfer failed: {sender.failure_reason}")
        elif state == KVPoll.Success and req in self.inflight:
            self.scheduler.finish(req, FinishReason("length"))

    # -- sending -------------------------------------------------------------------------------
    def on_computed(self, req: Req, extend_len: int, sampled: Sampled | None) -> bool:
        if req not in self.outbound:
            return False
        if sampled is None:  # a middle chunk; the last one goes with the aux record, once the first token is known
            self._send(req, req.kv_len, aux=None)
            return True
        token, logprob, top = sampled
        aux = AuxRecord(req.rendezvous.room, token, req.prefix_hit_len, len(req.prompt_ids), logprob, top)
        self._send(req, len(req.prompt_ids), aux=aux.pack())  # first: the decode's first token waits on it
        self.scheduler.output.commit_token(req, token, logprob, top)
        req.status = ReqStatus.TRANSFERRING
        self.inflight.append(req)
        return True

    def _send(self, req: Req, upto: int, aux: bytes | None) -> None:
        """Queue the pages holding tokens [sent, upto) of `req`; `upto` is page-aligned except at the end."""
        out = self.outbound[req]
        pages = self.scheduler.memory.page_ids(req, out.sent_tokens, upto)
        out.sent_tokens = upto
        out.sender.send(pages, is_last=aux is not None, aux=aux)

    # -- exits ---------------------------------------------------------------------------------
    def release(self, req: Req, reason: FinishReason) -> bool:
        out = self.outbound.pop(req, None)
        if out is not None:
            if reason.type == "abort":
                out.sender.abort(reason.message or "aborted")
            out.sender.release()  # drop the room from the manager's table
        for q in (self.awaiting_decode, self.inflight):
            if req in q:
                q.remove(req)
        return True

    def requests(self) -> list[Req]:
        return self.awaiting_decode + self.inflight

    def check_integrity(self) -> None:
        if any(req.finished for req in self.outbound) or not {*self.awaiting_decode, *self.inflight} <= set(self.outbound):
            raise MemoryIntegrityError("a prefill room is held by a finished request, or a queued request has none")

    def info(self) -> dict:
        return {"instance_id": self.kv_manager.instance_id, "control_endpoint": self.kv_manager.endpoint, **self.queue_depths()}

    def queue_depths(self) -> dict[str, int]:
        return {"awaiting_decode": len(self.awaiting_decode), "inflight": len(self.inflight)}

    def health_problem(self) -> str | None:
        return self.kv_manager.health_problem()
