"""Requests generating tokens, and the next decode step: one token for each of them, from tensors kept
across steps (DecodeTensors) and slots allocated for the whole batch at once. When the pages their next
tokens need do not fit, requests are retracted (the lowest priority, then the least progress; their KV
kept in the prefix cache, and with a host tier behind it copied there rather than dropped when evicted;
the scheduler queues each for prefill again, its KV matched back later) until the rest fit. What a request needs
to join them is common/engine/decode_reserve.py's."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from common.config import ServerConfig
from common.core.forward_batch import ForwardMode
from common.core.request import Req, ReqStatus
from common.engine.decode_tensors import DecodeTensors
from common.engine.model_runner import BatchPlan
from common.memory.manager import MemoryManager

if TYPE_CHECKING:
    from common.engine.spec.plan import SpecPlanner

log = logging.getLogger(__name__)


class DecodeBatch:
    def __init__(self, config: ServerConfig, memory: MemoryManager):
        self.config, self.memory = config, memory
        self.running: list[Req] = []
        self.tensors = DecodeTensors(config.device)
        self.num_retractions = 0
        self.spec: SpecPlanner | None = None  # speculative decoding: asked first every step (common/engine/spec/)

    def add(self, req: Req) -> None:
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def remove(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)

    def verify_plan(self) -> BatchPlan | None:
        """Speculative decoding's verify of the running requests, their slots allocated; None: no speculation,
        nothing runs, or the drafts do not fit (a plain step then)."""
        if self.spec is None or not self.running:
            return None
        plan = self.spec.plan(self.running)
        if plan is not None:
            self.tensors.current = False  # the requests moved on by several tokens: rebuilt next time
        return plan

    def fits(self) -> bool:
        """Whether the pages the running requests' next tokens need are free: one per request whose last page is
        full (host-side lengths)."""
        page_size = self.config.page_size
        return sum(1 for r in self.running if r.kv_len % page_size == 0) <= self.memory.available_pages()

    def schedule(self) -> BatchPlan | None:
        """One token for every running request, or None: nothing runs, or they do not fit (the scheduler then
        retracts, or ends `running[0]` when it runs alone)."""
        if not self.running or not self.fits():
            return None
        batch = self.tensors.prepare(self.running)
        first_slots = self.memory.alloc_decode_pages(batch.reqs)
        try:
            batch.upload(first_slots, self.config.page_size)
            locs = self.memory.write_decode_slots(batch.req_pool_indices, batch.positions, batch.new_slots)
        except Exception:  # the slots were never written: the requests give them back before they fail
            self.memory.undo_decode_pages(batch.reqs, first_slots)
            raise
        n = len(batch.reqs)
        return BatchPlan(ForwardMode.DECODE, batch.reqs, [1] * n, [locs], [True] * n, decode=batch)

    def victim(self) -> Req:
        """Who is retracted first: the lowest priority, then the least progress, then the newest."""
        return min(reversed(self.running), key=lambda r: (r.priority, len(r.output_ids)))

    def retract(self, req: Req) -> Req:
        """Give back a running request's KV (kept in the prefix cache); returns it, for the scheduler to queue."""
        self.running.remove(req)
        self.tensors.current = False  # they describe a batch with it: a later batch of the same requests rebuilds them
        self.memory.release(req)
        req.status = ReqStatus.WAITING
        self.num_retractions += 1
        log.info("retracted %s (%d output tokens) to free KV pages", req.rid, len(req.output_ids))
        return req
