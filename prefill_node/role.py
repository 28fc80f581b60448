"""Prefill role: a request is prefilled (in chunks) by the scheduler as soon as it arrives, while its
decode reserves pages; each computed chunk's KV pages go to the decode once it has said where (its room
request: its pages for the prompt past the prefix its own cache holds, `cached_prefix_len`; the pages
before that are never sent), the aux record with the last chunk; then the request waits in `inflight`
until the transfer is done, and its KV stays in the radix cache.

    scheduler's prefill queue --(prompt computed)--> inflight --(room Success/Failed)--> done
      row + KV; each chunk sent once paired          row + KV; the rest sent once paired

Pairing overlaps the forward (vLLM's NIXL connector also computes first): the prefill does not wait
for the decode's round trip before computing. A request whose decode has not asked for its room within
--pairing-timeout-s fails with 504, freeing what it holds.

Computing ahead is bounded, else two requests can wait on each other across the pair: the decode
reserved Y's pages and waits for Y's KV before it can reserve X's, while the prefill computed X first and
X's unsendable KV holds the pages Y needs. Requests computed ahead of their pairing hold at most the pool
less one longest request (the context length) and all rows but one, so a paired request always gets
memory once the paired ones before it have sent their KV. Past that bound a request is `deferred`: it
holds nothing and joins the prefill queue when its decode pairs (SGLang's order).

    deferred --(decode paired, or the bound has space)--> prefill queue (computed ahead while unpaired)

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
from common.core.page_meta import pages_for
from common.core.request import FinishReason, Req, ReqStatus
from common.engine.decode_reserve import decode_reserve
from common.engine.pd_role import PDRole
from common.engine.role import Sampled, SchedulerView
from common.engine.spec.head_drafter import HiddenHandoff
from common.memory.errors import MemoryIntegrityError
from transfer.aux_record import AuxRecord
from transfer.poll import DuplicateRoom, KVPoll
from transfer.prefill.prefill_manager import PrefillKVManager
from transfer.prefill.sender import KVSender

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Outbound:
    """One request's transfer: its sender, how far its prompt is computed and how much of that is queued,
    and the aux record until it is queued (with the last pages)."""

    sender: KVSender
    paired: bool = False  # the decode said where the pages go
    computed_tokens: int = 0
    sent_tokens: int = 0
    aux: bytes | None = None


class PrefillRole(PDRole):
    mode = "prefill"
    kv_manager: PrefillKVManager

    def __init__(
        self,
        scheduler: SchedulerView,
        kv_manager: PrefillKVManager,
        config: ServerConfig,
        hidden: HiddenHandoff | None = None,
    ):
        """`kv_manager` wakes `scheduler` (its wake_scheduler) when a room moves; `hidden`: NEXTN's or EAGLE's drafter,
        whose hidden state of the prompt's last position goes in the aux record."""
        super().__init__(kv_manager)
        self.scheduler, self.config, self.hidden = scheduler, config, hidden
        self.inflight: list[Req] = []  # prompt computed, KV on its way (or waiting for the decode to pair)
        self.deferred: list[Req] = []  # not computing until their decode pairs: the bound on computing ahead is reached
        self.ahead: dict[Req, int] = {}  # computing or computed while unpaired -> the pages it may take
        self.outbound: dict[Req, Outbound] = {}
        self.ahead_page_limit = scheduler.memory.page_counts().total - self._pages(scheduler.context_len)

    # -- admission -----------------------------------------------------------------------------
    def admit(self, req: Req) -> bool:
        if req.params.max_new_tokens == 0:
            return False  # nothing to hand over: computed here, answered here
        try:
            sender = KVSender(self.kv_manager, req.rendezvous.room_id, req.timeline.mark, self.scheduler.dp_rank)
            self.outbound[req] = Outbound(sender)
        except DuplicateRoom as e:
            self.scheduler.fail(req, str(e), 409)
            return True
        self.deferred.append(req)
        self._start_deferred()  # computed at once, while the decode reserves its pages, if the bound has space
        return True

    def poll(self) -> None:
        for req in list(self.outbound):
            self.scheduler.guarded(req, "sending its KV", lambda: self._poll_room(req))
        self._start_deferred()

    def _start_deferred(self) -> None:
        """Queue for prefill every deferred request whose decode paired, and each unpaired one (in order)
        that the bound on computing ahead still has space for."""
        for req in list(self.deferred):
            if not self.outbound[req].paired:
                pages = self._pages(len(req.prompt_ids) + decode_reserve(req))
                if (
                    sum(self.ahead.values()) + pages > self.ahead_page_limit
                    or len(self.ahead) + 2 > self.config.max_running_requests
                ):
                    continue
                self.ahead[req] = pages
            self.deferred.remove(req)
            self.scheduler.queue_for_prefill(req)

    def _pages(self, tokens: int) -> int:
        return pages_for(tokens, self.config.page_size)

    def _poll_room(self, req: Req) -> None:
        """A room that failed ends its request at once, also one whose prompt is still being computed (its
        remaining chunks would go nowhere)."""
        out = self.outbound.get(req)
        if out is None:
            return
        state = out.sender.poll()
        if state == KVPoll.Failed:
            what = "KV transfer failed" if out.paired else "decode peer failed before the transfer"
            self.scheduler.fail(req, f"{what}: {out.sender.failure_reason}")
        elif state == KVPoll.Success and req in self.inflight:
            self.scheduler.finish(req, FinishReason("length"))
        elif not out.paired and state >= KVPoll.WaitingForInput:
            self._flush(req, out)
        elif not out.paired and self.scheduler.clock() - req.arrival_time > self.config.pairing_timeout_s:
            self.scheduler.fail(
                req,
                f"no decode server reserved memory for room {req.rendezvous.room_id} "
                f"within {self.config.pairing_timeout_s:g} s",
                504,
            )

    # -- sending -------------------------------------------------------------------------------
    def on_computed(self, req: Req, extend_len: int, sampled: Sampled | None) -> bool:
        out = self.outbound.get(req)
        if out is None:
            return False
        out.computed_tokens = req.kv_len if sampled is None else len(req.prompt_ids)
        if sampled is not None:  # the last chunk goes with the aux record, once the first token is known
            token, logprob, top = sampled
            hidden = self.hidden.pending_bytes(req) if self.hidden is not None else b""
            out.aux = AuxRecord(
                req.rendezvous.room_id, token, req.prefix_hit_len, len(req.prompt_ids), logprob, top, hidden
            ).pack()
        self._flush(req, out)  # first: the decode's first token waits on it
        if sampled is None or req.finished:
            return True
        self.scheduler.commit_token(req, token, logprob, top)
        req.status = ReqStatus.TRANSFERRING
        self.inflight.append(req)
        return True

    def _flush(self, req: Req, out: Outbound) -> None:
        """Queue the pages of tokens computed but not yet queued (page-aligned but at the prompt's end),
        with the aux record once the prompt is complete; nothing until the decode has said where."""
        if not out.paired and (out.sender.poll() < KVPoll.WaitingForInput or not self._pair(req, out)):
            return
        if out.sent_tokens >= out.computed_tokens and out.aux is None:
            return  # nothing new, or only pages the decode has cached
        end = max(out.sent_tokens, out.computed_tokens)
        pages = self.scheduler.memory.page_ids(req, out.sent_tokens, end)
        aux, out.aux, out.sent_tokens = out.aux, None, end
        out.sender.send(pages, is_last=aux is not None, aux=aux, ready=req.kv_ready)

    def _pair(self, req: Req, out: Outbound) -> bool:
        """The decode asked for the room: True if its pages fit the prompt past the prefix it has cached
        (sending starts there), else the request fails."""
        n, cached = len(req.prompt_ids), out.sender.cached_prefix_len
        if cached % self.config.page_size or not 0 <= cached < n:
            ps = self.config.page_size
            problem = f"decode's cached_prefix_len {cached} must be a multiple of the page size {ps} below the prompt's {n} tokens"
            self.scheduler.fail(req, problem, 500)
            return False
        if out.sender.lora != (req.lora or ""):
            theirs, mine = out.sender.lora or "the base model", req.lora or "the base model"
            self.scheduler.fail(req, f"the decode runs this request under {theirs!r}, this prefill under {mine!r}", 500)
            return False
        need = self._pages(n) - cached // self.config.page_size
        if out.sender.num_dst_pages != need:
            self.scheduler.fail(
                req,
                f"decode reserved {out.sender.num_dst_pages} pages, the prompt needs {need} past its cached {cached} tokens",
                500,
            )
            return False
        out.sent_tokens = cached
        out.paired = True
        self.ahead.pop(req, None)
        return True

    # -- exits ---------------------------------------------------------------------------------
    def release(self, req: Req, reason: FinishReason) -> bool:
        out = self.outbound.pop(req, None)
        if out is not None:
            if reason.type == "abort":
                out.sender.abort(reason.message or "aborted")
            out.sender.release()  # drop the room from the manager's table
        for queue in (self.inflight, self.deferred):
            if req in queue:
                queue.remove(req)
        self.ahead.pop(req, None)
        return True

    def requests(self) -> list[Req]:
        return self.inflight + self.deferred

    def check_integrity(self) -> None:
        if any(req.finished for req in self.outbound) or not {*self.inflight, *self.deferred, *self.ahead} <= set(
            self.outbound
        ):
            raise MemoryIntegrityError("a prefill room is held by a finished request, or a queued request has none")

    def queue_depths(self) -> dict[str, int]:
        """awaiting_decode: requests whose decode has not said where their KV goes (deferred, computing or
        computed); deferred: of those, the ones not computing until it does."""
        return {
            "awaiting_decode": sum(1 for out in list(self.outbound.values()) if not out.paired),
            "inflight": len(self.inflight),
            "deferred": len(self.deferred),
        }
