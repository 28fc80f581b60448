"""Requests whose prompt (or its rest) is still to be computed, and the choice of the next prefill
batch: by priority then FIFO, a token budget per batch, page-aligned chunks of at most --chunked-prefill-size tokens, and
memory checked before each chunk (a request admitted but not fitting is given back at once)."""

from __future__ import annotations

from collections import deque

from common.config import ServerConfig
from common.core.forward_batch import ForwardMode
from common.core.request import Req, queue_position
from common.engine.decode_reserve import decode_reserve
from common.engine.model_runner import BatchPlan
from common.lora.manager import LoraManager
from common.memory.manager import MemoryManager


class PrefillQueue:
    def __init__(self, config: ServerConfig, memory: MemoryManager, lora: LoraManager | None = None):
        """`lora`: --enable-lora's adapters; a request is admitted only once its adapter holds a slot."""
        self.config, self.memory, self.lora = config, memory, lora
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # the request whose next chunk runs before anyone else's
        # --enable-deterministic-inference on CUDA: one request per prefill forward, so FlashInfer's query tile
        # (picked from the batch's mean rows per request) follows the request's chunk alone (flashinfer_backend.py)
        self.per_forward = 1 if config.enable_deterministic_inference and config.device == "cuda" else 1 << 30
        self.plan: BatchPlan | None = None  # the plan schedule() is building (read when it raises)
        self.considering: Req | None = None

    def add(self, req: Req) -> None:
        """Behind every waiting request of its priority or higher (all 0 without priorities: FIFO); what the
        prefix cache could bring closer for it (a KV store's pages) starts coming now."""
        self.waiting.insert(queue_position(self.waiting, req), req)
        if not self.config.disable_radix_cache:
            self.memory.prefix_cache.prefetch(req, req.cache_key[: self._match_limit(req)])

    def add_front(self, req: Req) -> None:
        """A retracted request: ahead of the waiting requests of its priority, behind higher ones."""
        self.waiting.insert(queue_position(self.waiting, req, ahead_of_equals=True), req)

    def remove(self, req: Req) -> None:
        if self.chunked is req:
            self.chunked = None
        if req in self.waiting:
            self.waiting.remove(req)

    def pending_tokens(self) -> int:
        """Prompt tokens still to compute (read from the /metrics thread: a snapshot, retried if the scheduler
        changed the queue while it was copied)."""
        for _ in range(3):
            try:
                reqs = [*self.waiting, *([self.chunked] if self.chunked else [])]
                break
            except RuntimeError:  # deque mutated during iteration
                continue
        else:
            return 0
        return sum(max(0, len(r.prompt_ids) + len(r.output_ids) - r.kv_len) for r in reqs)

    def requests(self) -> list[Req]:
        return [*self.waiting, *([self.chunked] if self.chunked else [])]

    def schedule(self, slots_left: int, decode_idle: bool) -> BatchPlan | None:
        """The next prefill batch; `slots_left`: how many more requests may start running."""
        budget = self.config.max_prefill_tokens
        plan = self.plan = BatchPlan(ForwardMode.EXTEND, [], [], [], [])
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            used = self._add_chunk(plan, req, budget, decode_idle)
            if used == 0:
                self.chunked = req  # wait for memory; admit nobody ahead of it
                return None
            budget -= used
        while budget > 0 and self.chunked is None and len(plan.reqs) < min(slots_left, self.per_forward):
            req = self.considering = self._next_ready()
            if req is None:
                break
            if req.req_pool_idx is None:
                if not self.memory.can_admit() or not (self.lora is None or self.lora.can_admit(req)):
                    break
                self._admit(req)
            used = self._add_chunk(plan, req, budget, decode_idle)
            if used == 0:
                self.memory.release(req)
                break
            self.waiting.remove(req)
            budget -= used
        self.considering = None
        return plan if plan.reqs else None

    def _next_ready(self) -> Req | None:
        """The first waiting request the prefix cache lets run (one whose prefetch from the store is still
        in flight may have to wait: --hicache-storage-prefetch-policy); the others keep their places."""
        ready = self.memory.prefix_cache.ready
        return next((r for r in self.waiting if r.req_pool_idx is not None or ready(r)), None)

    @staticmethod
    def _match_limit(req: Req) -> int:
        limit = len(req.fill_ids) - 1  # at least one token must run to produce logits
        return min(limit, req.logprob_start_len) if req.logprob_start_len >= 0 else limit

    def _admit(self, req: Req) -> None:
        if self.lora is not None:
            self.lora.admit(req)
        self.memory.admit(req, 0 if self.config.disable_radix_cache else self._match_limit(req))
        if not req.output_ids:
            req.prefix_hit_len = req.cached_len

    def _chunk_len(self, req: Req, budget: int) -> int:
        """Tokens of the next chunk: all that remain, or a page-aligned piece within the budget."""
        remaining = len(req.fill_ids) - req.kv_len
        limit = budget
        if self.config.chunked_prefill_enabled:
            limit = min(limit, self.config.chunked_prefill_size)
        if remaining <= limit:
            return remaining
        return limit - (req.kv_len + limit) % self.config.page_size

    def _add_chunk(self, plan: BatchPlan, req: Req, budget: int, decode_idle: bool) -> int:
        """Add the next chunk of `req` to the plan if memory allows; returns its length or 0."""
        n = self._chunk_len(req, budget)
        is_last = n == len(req.fill_ids) - req.kv_len
        reserve = decode_reserve(req) if is_last else 0
        alone = decode_idle and not plan.reqs
        if n <= 0 or not (self.memory.can_extend(req, n + reserve) or (alone and self.memory.can_extend(req, n))):
            return 0
        plan.reqs.append(req)
        plan.extend_lens.append(n)
        plan.out_cache_locs.append(self.memory.extend(req, n))
        plan.sample.append(is_last)
        if not is_last:
            self.chunked = req
        return n
