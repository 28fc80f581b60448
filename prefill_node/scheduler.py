"""Prefill role: a request waits in the bootstrap queue until decode has reserved memory for it, is
prefilled (in chunks), streams each chunk's KV pages to decode, sends aux data last, and waits in the
inflight queue until the transfer is done; then its KV stays in the radix cache.

    bootstrap queue --(decode sent page indices)--> waiting --(prefill chunks, KV sent)--> inflight --> done
         |  no row, no KV                          row + KV owned      row + KV owned until Success/Failed

Who frees what: every exit goes through Scheduler.finish -> KVCacheManager.release (computed KV into
the radix cache), after the sender was told to stop. A write already in flight may still read those
pages; that only sends stale bytes into the decode's pages of a room that has failed, which decode
reuses only after this side's failure status, queued behind that write.
"""
from __future__ import annotations

import logging
import time

import torch

from common.engine.model_runner import BatchResult
from common.engine.request import FinishReason, Req, ReqStatus
from common.engine.scheduler import Scheduler
from transfer.aux_record import AuxRecord
from transfer.poll import KVPoll
from transfer.prefill_manager import PrefillKVManager
from transfer.sender import KVSender

log = logging.getLogger(__name__)


class PrefillScheduler(Scheduler):
    def __init__(self, *args, kv_manager: PrefillKVManager, **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_manager = kv_manager
        self.bootstrap_queue: list[Req] = []
        self.inflight: list[Req] = []
        self.senders: dict[str, KVSender] = {}
        self.sent_tokens: dict[str, int] = {}

    # -- admission -----------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.output.prepare(req)
        if req.bootstrap is None:
            self.finish(req, FinishReason("abort", message="a prefill server needs bootstrap_room: send requests through the router", status=400))
            return
        self.senders[req.rid] = KVSender(self.kv_manager, req.bootstrap["bootstrap_room"])
        req.status = ReqStatus.BOOTSTRAPPING
        self.bootstrap_queue.append(req)

    def poll_role_queues(self) -> None:
        now = time.monotonic()
        for req in list(self.bootstrap_queue):
            sender = self.senders[req.rid]
            state = sender.poll()
            if state == KVPoll.Failed:
                self._fail(req, f"decode peer failed before the transfer: {sender.failure_reason}")
            elif state >= KVPoll.WaitingForInput:
                self._start_prefill(req, sender)
            elif now - req.arrival_time > self.config.bootstrap_timeout_s:
                self._fail(req, f"no decode server reserved memory for room {req.bootstrap['bootstrap_room']} within {self.config.bootstrap_timeout_s:g} s", 504)
        for req in list(self.inflight):
            sender = self.senders[req.rid]
            state = sender.poll()
            if state == KVPoll.Success:
                self.inflight.remove(req)
                self.finish(req, FinishReason("length"))
            elif state == KVPoll.Failed:
                self._fail(req, f"KV transfer failed: {sender.failure_reason}")

    def _start_prefill(self, req: Req, sender: KVSender) -> None:
        need = -(-len(req.prompt_ids) // self.config.page_size)
        self.bootstrap_queue.remove(req)
        if sender.num_dst_pages != need:
            self._fail(req, f"decode reserved {sender.num_dst_pages} pages, the prompt needs {need}", 500)
            return
        req.status = ReqStatus.WAITING
        self.sent_tokens[req.rid] = 0
        self.waiting.append(req)

    # -- sending -------------------------------------------------------------------------------
    def on_prefill_chunk(self, req: Req, extend_len: int, last: bool) -> None:
        if not last:  # the last chunk goes with the aux record, once the first token is known
            self._send(req, req.kv_len, aux=None)

    def on_prefill_done(self, req: Req, result: BatchResult, index: int) -> bool:
        token = result.token_ids[index]
        aux = AuxRecord(req.bootstrap["bootstrap_room"], token, req.prefix_hit_len, len(req.prompt_ids),
                        result.logprobs[index], result.top_logprobs[index])
        self.output.commit_token(req, token, result.logprobs[index], result.top_logprobs[index])
        self._send(req, len(req.prompt_ids), aux=aux.pack())
        req.status = ReqStatus.TRANSFERRING
        self.inflight.append(req)
        return False

    def _send(self, req: Req, upto: int, aux: bytes | None) -> None:
        """Queue the pages holding tokens [sent, upto) of `req`; `upto` is page-aligned except at the end."""
        page = self.config.page_size
        start = self.sent_tokens[req.rid]
        slots = self.kv.req_pool.req_to_token[req.req_pool_idx, start:upto:page]
        pages = (slots.to(torch.int64) // page).tolist()
        self.sent_tokens[req.rid] = upto
        self.senders[req.rid].send(pages, is_last=aux is not None, aux=aux)

    # -- exits ---------------------------------------------------------------------------------
    def _fail(self, req: Req, message: str, status: int = 502) -> None:
        log.warning("request %s failed: %s", req.rid, message)
        self.finish(req, FinishReason("abort", message=message, status=status))

    def finish(self, req: Req, reason: FinishReason) -> None:
        sender = self.senders.pop(req.rid, None)
        if sender is not None:
            if reason.type == "abort":
                sender.abort(reason.message or "aborted")
            sender.release()  # drop the room from the manager's table
        for q in (self.bootstrap_queue, self.inflight):
            if req in q:
                q.remove(req)
        self.sent_tokens.pop(req.rid, None)
        super().finish(req, reason)

    def role_has_work(self) -> bool:
        return bool(self.bootstrap_queue or self.inflight)

    def role_requests(self) -> list[Req]:
        return self.bootstrap_queue + self.inflight

    def num_held_elsewhere(self) -> int:
        return len(self.inflight)

    def role_info(self) -> dict:
        return {"instance_id": self.kv_manager.instance_id, "control_endpoint": self.kv_manager.endpoint,
                "bootstrap_queue": len(self.bootstrap_queue), "inflight": len(self.inflight)}
