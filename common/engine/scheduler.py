"""Continuous batching: one `step()` = pick a batch, run it, commit its results.

Prefill has priority (as in SGLang): a step runs new/chunked prompts when any wait and fit, else one
decode token for every running request. Roles (PD prefill / decode) extend this class through the
hooks at the bottom; the monolithic server uses it as is.
"""
from __future__ import annotations

import logging
import queue
from collections import deque
from typing import Callable

from common.config import ServerConfig
from common.engine.decode_batch import DecodeBatch
from common.engine.forward_batch import ForwardMode
from common.engine.model_runner import BatchPlan, BatchResult, ModelRunner
from common.engine.output import OutputProcessor
from common.engine.request import FinishReason, Req, ReqStatus
from common.memory.errors import MemoryIntegrityError
from common.memory.manager import KVCacheManager, PageCounts

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: ServerConfig, runner: ModelRunner | None, kv: KVCacheManager, output: OutputProcessor):
        self.config = config
        self.runner = runner
        self.kv = kv
        self.output = output
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self.num_retractions = 0
        self.decode_batch = DecodeBatch(config.device)

    # -- called from other threads -------------------------------------------------------------
    def submit(self, req: Req) -> None:
        self.inbox.put(("add", req))

    def abort(self, req: Req, reason: str = "aborted by client", status: int = 499) -> None:
        """End `req` (the object, not its rid: clients may reuse rids) at the next step."""
        self.inbox.put(("abort", (req, reason, status)))

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread between two steps."""
        self.inbox.put(("call", fn))

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling round. Returns False when there was nothing to do."""
        self.drain_inbox()
        self.poll_role_queues()
        plan = self.schedule_prefill() or self.schedule_decode()
        if plan is None:
            return False
        try:
            self.process_result(plan, self.runner.run(plan))
        except Exception as e:  # the batch's requests may be in no queue now: answer them here
            log.exception("a batch of %d requests failed", len(plan.reqs))
            for req in plan.reqs:
                if not req.finished:
                    self.finish(req, FinishReason("abort", message=f"internal error running the batch: {e!r}", status=500))
        return True

    def num_queued(self) -> int:
        """Requests not yet running (read from other threads: an estimate)."""
        return len(self.waiting) + len(self.role_requests())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked) or self.role_has_work()

    def drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._admit_or_fail(arg)
            elif kind == "abort":
                self.abort_now(*arg)
            else:
                arg()

    def _admit_or_fail(self, req: Req) -> None:
        """A request that cannot even be queued still gets an answer (its client would wait forever)."""
        try:
            self.add_request(req)
        except Exception as e:
            log.exception("request %s could not be queued", req.rid)
            if not req.finished:
                self.finish(req, FinishReason("abort", message=f"internal error queueing the request: {e!r}", status=500))

    def add_request(self, req: Req) -> None:
        self.output.prepare(req)
        self.waiting.append(req)

    # -- prefill -------------------------------------------------------------------------------
    def schedule_prefill(self) -> BatchPlan | None:
        budget = self.config.max_prefill_tokens
        plan = BatchPlan(ForwardMode.EXTEND, [], [], [], [])
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            used = self._add_chunk(plan, req, budget)
            if used == 0:
                self.chunked = req  # wait for memory; admit nobody ahead of it
                return None
            budget -= used
        while self.waiting and budget > 0 and self.chunked is None and self._has_room_for_another(plan):
            req = self.waiting[0]
            if req.req_pool_idx is None:
                if not self.kv.can_admit():
                    break
                self._admit(req)
            used = self._add_chunk(plan, req, budget)
            if used == 0:
                self.kv.release(req, cache=False)
                break
            self.waiting.popleft()
            budget -= used
        return plan if plan.reqs else None

    def _admit(self, req: Req) -> None:
        limit = len(req.fill_ids) - 1  # at least one token must run to produce logits
        if req.logprob_start_len >= 0:
            limit = min(limit, req.logprob_start_len)
        self.kv.admit(req, 0 if self.config.disable_radix_cache else limit)
        if not req.output_ids:
            req.prefix_hit_len = req.cached_len

    def _has_room_for_another(self, plan: BatchPlan) -> bool:
        return len(self.running) + len(plan.reqs) + self.num_held_elsewhere() < self.config.max_running_requests

    def _chunk_len(self, req: Req, budget: int) -> int:
        """Tokens of the next chunk: all that remain, or a page-aligned piece within the budget."""
        remaining = len(req.fill_ids) - req.kv_len
        limit = budget
        if self.config.chunked_prefill_enabled:
            limit = min(limit, self.config.chunked_prefill_size)
        if remaining <= limit:
            return remaining
        return limit - (req.kv_len + limit) % self.config.page_size

    def _add_chunk(self, plan: BatchPlan, req: Req, budget: int) -> int:
        """Add the next chunk of `req` to the plan if memory allows; returns its length or 0."""
        n = self._chunk_len(req, budget)
        is_last = n == len(req.fill_ids) - req.kv_len
        reserve = min(req.params.max_new_tokens, 16) if is_last else 0  # room for the first decode steps
        alone = not self.running and not plan.reqs
        if n <= 0 or not (self.kv.can_extend(req, n + reserve) or (alone and self.kv.can_extend(req, n))):
            return 0
        plan.reqs.append(req)
        plan.extend_lens.append(n)
        plan.out_cache_locs.append(self.kv.extend(req, n))
        plan.sample.append(is_last)
        if not is_last:
            self.chunked = req
        return n

    # -- decode --------------------------------------------------------------------------------
    def schedule_decode(self) -> BatchPlan | None:
        if not self.running:
            return None
        batch = self.decode_batch.prepare(self.running)
        while len(self.running) > 1 and not self._decode_fits(batch):
            self.retract(self.running[-1])
            batch = self.decode_batch.prepare(self.running)
        if not self._decode_fits(batch):
            self.finish(self.running[0], FinishReason("abort", message="KV cache exhausted", status=503))
            return None
        locs = self.kv.extend_decode(batch.reqs, batch.req_pool_indices, batch.positions, batch.seq_lens)
        n = len(batch.reqs)
        return BatchPlan(ForwardMode.DECODE, batch.reqs, [1] * n, [locs], [True] * n, decode=batch)

    def _decode_fits(self, batch: DecodeBatch) -> bool:
        return batch.new_page_count(self.config.page_size) <= self.kv.available_pages()

    def retract(self, req: Req) -> None:
        """Give back a running request's KV (kept in the prefix cache) and queue it again."""
        self.running.remove(req)
        self.kv.release(req, cache=not self.config.disable_radix_cache)
        req.status = ReqStatus.WAITING
        req.retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        log.info("retracted %s (%d output tokens) to free KV pages", req.rid, len(req.output_ids))

    # -- results -------------------------------------------------------------------------------
    def process_result(self, plan: BatchPlan, result: BatchResult) -> None:
        for i, req in enumerate(plan.reqs):
            if result.input_logprobs[i] is not None:
                self.output.add_input_logprobs(req, plan.extend_lens[i], result.input_logprobs[i])
            if req.finished:  # aborted while the batch ran
                continue
            if plan.mode == ForwardMode.EXTEND:
                self.on_prefill_chunk(req, plan.extend_lens[i], last=plan.sample[i])
            if not plan.sample[i]:
                continue
            if plan.mode == ForwardMode.EXTEND and not self.on_prefill_done(req, result, i):
                continue
            finish = self.output.commit_token(req, result.token_ids[i], result.logprobs[i], result.top_logprobs[i])
            if finish is not None:
                self.finish(req, finish)
            elif req.status != ReqStatus.RUNNING:
                req.status = ReqStatus.RUNNING
                self.running.append(req)

    def finish(self, req: Req, reason: FinishReason) -> None:
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        if req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req, cache=not self.config.disable_radix_cache)
        req.status = ReqStatus.FINISHED
        self.output.finish(req, reason)

    def abort_now(self, req: Req, reason: str, status: int) -> None:
        if not req.finished:
            self.finish(req, FinishReason("abort", message=reason, status=status))

    def check_integrity(self) -> PageCounts:
        """Raises on a leak of rows, pages or role resources; returns the page counts."""
        counts = self.kv.check_integrity()
        known = {id(r) for r in self.tracked_requests()}
        strays = [r.rid for r in self.kv.live.values() if id(r) not in known]
        if strays:
            raise MemoryIntegrityError(f"rows held by requests no queue knows: {strays}")
        return counts

    def tracked_requests(self) -> list[Req]:
        """Every request a queue of this scheduler holds (the role's queues included)."""
        return [*self.waiting, *self.running, *([self.chunked] if self.chunked else []), *self.role_requests()]

    # -- role hooks (PD) -----------------------------------------------------------------------
    def poll_role_queues(self) -> None:
        """Move requests between the role's own queues and the scheduler's."""

    def role_has_work(self) -> bool:
        return False

    def role_requests(self) -> list[Req]:
        return []

    def num_held_elsewhere(self) -> int:
        """Requests holding a row outside `running` (e.g. waiting for a KV transfer)."""
        return 0

    def role_info(self) -> dict:
        """What the role adds to /get_server_info."""
        return {}

    def on_prefill_chunk(self, req: Req, extend_len: int, last: bool) -> None:
        """The KV of `extend_len` more tokens of `req` is now in the pool."""

    def on_prefill_done(self, req: Req, result: BatchResult, index: int) -> bool:
        """The whole prompt is in the pool and a token was sampled. False: the role takes the request."""
        return True
