"""Requests generating tokens, and the next decode step: one token for each of them, from tensors kept
across steps (DecodeTensors) and slots allocated for the whole batch at once. When the pages their next
tokens need do not fit, requests are retracted (the lowest priority, then the least progress; their KV
kept in the prefix cache, and with a host tier behind it copied there rather than dropped when evicted;
the request queued for prefill again, its KV matched back later) until the rest fit. `decode_reserve` is what
a request needs to join them, the one rule of every admission to decoding (the prefill queue's, a PD prefill's,
a decode's)."""

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
    from common.engine.prefill_queue import PrefillQueue

log = logging.getLogger(__name__)
FIRST_DECODE_STEPS = 16  # token slots kept past a prompt (at most) for its first decode steps


def decode_reserve(req: Req) -> int:
    """The slots a request's first decode steps need beyond its prompt, what admission to decoding asks: the
    prefill queue keeps them free when it computes a prompt's last chunk, a PD prefill counts them in its bound
    on computing ahead, and a decode reserves them with the prompt's pages: the deadlock bound of
    prefill_node/role.py holds only while all three agree, so this is their one definition."""
    return min(req.params.max_new_tokens, FIRST_DECODE_STEPS)


class DecodeBatch:
    def __init__(self, config: ServerConfig, memory: MemoryManager, prefill: PrefillQueue):
        self.config, self.memory, self.prefill = config, memory, prefill
        self.running: list[Req] = []
        self.tensors = DecodeTensors(config.device)
        self.num_retractions = 0

    def add(self, req: Req) -> None:
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def remove(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)

    def schedule(self) -> BatchPlan | None:
        """One token for every running request, or None: nothing runs, or not even one fits (the
        caller then ends `running[0]`)."""
        if not self.running:
            return None
        batch = self.tensors.prepare(self.running)
        while not self._fits(batch):
            if len(self.running) == 1:
                return None
            self.retract(self.victim())
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

    def _fits(self, batch: DecodeTensors) -> bool:
        return batch.new_page_count(self.config.page_size) <= self.memory.available_pages()

    def retract(self, req: Req) -> None:
        """Give back a running request's KV (kept in the prefix cache) and queue it again."""
        self.running.remove(req)
        self.tensors.current = False  # they describe a batch with it: a later batch of the same requests rebuilds them
        self.memory.release(req)
        req.status = ReqStatus.WAITING
        self.num_retractions += 1
        self.prefill.add_front(req)
        log.info("retracted %s (%d output tokens) to free KV pages", req.rid, len(req.output_ids))
