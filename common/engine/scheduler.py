"""Continuous batching: one `step()` = take new work, let the role move its queues, pick a batch, run
it, commit its results.

Prefill has priority (as in SGLang): a step runs new/chunked prompts when any wait and fit, else one
decode token for every running request; a decode server's role (`Role.interleave_prefill`) runs one decode
step between two prefill steps, so a prompt it computes itself holds its batch up by one chunk at a time. The scheduler composes a PrefillQueue, a DecodeBatch, the
MemoryManager and a Role (PD prefill / decode; the base Role for a monolithic server).

Failure is per request: an exception while handling one request ends that request with a 500 naming
the cause; a batch whose forward fails ends the batch's requests, and the KV it was to write never
enters the prefix cache (MemoryManager.release caches only computed KV). Every request leaves through
finish(): out of every queue, the client answered, then its memory freed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from common.config import ServerConfig
from common.core.forward_batch import ForwardMode
from common.core.request import FinishReason, Req, ReqStatus
from common.engine.decode_batch import DecodeBatch
from common.engine.forward_stats import ForwardStats
from common.engine.model_runner import BatchPlan, BatchResult, ModelRunner
from common.engine.output import OutputProcessor
from common.engine.prefill_queue import PrefillQueue
from common.engine.role import Role
from common.engine.spec.commit import SpecStats, commit_verified
from common.engine.spec.verify import Verified
from common.lora.manager import LoraManager
from common.memory.errors import MemoryIntegrityError
from common.memory.manager import MemoryManager, PageCounts
from common.wire.api import rendezvous_problem

if TYPE_CHECKING:
    from common.engine.grammar.queue import GrammarQueue

log = logging.getLogger(__name__)
T = TypeVar("T")


class Scheduler:
    def __init__(
        self,
        config: ServerConfig,
        runner: ModelRunner | None,
        memory: MemoryManager,
        output: OutputProcessor,
        role: Role | None = None,
        clock: Callable[[], float] = time.monotonic,
        woken: threading.Event | None = None,
        dp_rank: int = 0,
        lora: LoraManager | None = None,
    ):
        """`woken`: the event the scheduler thread waits on (one for every DP rank's scheduler under DP
        attention, common.engine.dp_scheduler); `dp_rank`: whose requests, pool and batch these are; `lora`:
        --enable-lora's adapters (the runner's), whose slots admission pins and the exit frees."""
        self.config, self.runner, self.memory, self.output = config, runner, memory, output
        self.dp_rank = dp_rank
        self.clock = clock  # for the roles' timeouts; requests' arrival_time is on this clock
        self.lora = lora
        self.prefill = PrefillQueue(config, memory, self.lora)
        self.decode = DecodeBatch(config, memory)
        self.role = role or Role()
        self.inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self.woken = woken or threading.Event()  # set by wake(); the scheduler thread waits on it between steps
        self.starved_since: float | None = None  # since when no running request fits the pool (None: they fit)
        self._live = 0  # requests submitted and not finished (any thread reads it: see num_queued)
        self.live_tokens = 0  # their prompts' tokens (minimum_tokens balances DP ranks by it)
        self.served = 0  # requests submitted here, ever
        self._live_lock = threading.Lock()
        self.spec_stats: SpecStats | None = None  # speculative decoding's metrics (set with DecodeBatch.spec)
        self.grammars: GrammarQueue | None = None  # requests waiting for their grammar (None: --grammar-backend none)
        self.last_mode: ForwardMode | None = None  # of the last batch run
        self.step_start = 0.0  # when the running step's forward began (its cost goes to forward_stats)
        self.forward_stats = ForwardStats()  # what the forwards cost (the engine exposes it in /metrics)

    # -- called from other threads -------------------------------------------------------------
    def wake(self) -> None:
        """Something a step would act on happened (a request, a peer's message, a transfer's end):
        run the next step now instead of at the loop's next timeout."""
        self.woken.set()

    def submit(self, req: Req) -> None:
        with self._live_lock:
            self._live += 1
            self.live_tokens += len(req.prompt_ids)
            self.served += 1
        self.inbox.put(("add", req))
        self.wake()

    def abort(self, req: Req, reason: str = "aborted by client", status: int = 499) -> None:
        """End `req` (the object, not its rid: clients may reuse rids) at the next step."""
        self.inbox.put(("abort", (req, reason, status)))
        self.wake()

    def run_on_scheduler(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread between two steps."""
        self.inbox.put(("call", fn))
        self.wake()

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling round. Returns False when there was nothing to do."""
        plan = self.plan_step()
        if plan is None:
            return False
        self._run(plan)
        return True

    def plan_step(self) -> BatchPlan | None:
        """The first half of a step: take new work, let the role move its queues, pick the batch."""
        self.drain_inbox()
        self.memory.prefix_cache.poll()
        if self.grammars is not None:
            for req in self.grammars.take_ready():
                self.guarded(req, "queueing the request", lambda: self._admit(req))
        self.role.poll()
        return self._next_plan()

    def drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.guarded(arg, "queueing the request", lambda: self.add_request(arg))
            elif kind == "abort":
                req, reason, status = arg
                self.abort_now(req, reason, status)
            else:
                arg()

    def add_request(self, req: Req) -> None:
        req.timeline.mark("admitted")
        self.output.prepare(req)
        problem = rendezvous_problem(self.role.mode, req.rendezvous, req.pd_placement) if self.role.mode else None
        if problem is not None:
            self.fail(req, problem, 400)
        elif self.lora is not None and not self.lora.track(req):
            self.fail(req, f"lora adapter {req.lora!r} was unloaded after this request arrived", 404)
        elif req.grammar_spec is not None and self.grammars is None:
            self.fail(req, f"{req.grammar_spec.param} needs a grammar: this server runs --grammar-backend none", 400)
        elif req.grammar_spec is None or not self.grammars.park(req):
            self._admit(req)

    def _admit(self, req: Req) -> None:
        """To the role, or the prefill queue; a grammar that did not compile ends the request first."""
        error = req.grammar.error() if req.grammar is not None else None
        if error is not None:
            self.fail(req, f"{req.grammar_spec.param}: the grammar does not compile: {error}", 400)
        elif not self.role.admit(req):
            self.prefill.add(req)

    def abort_now(self, req: Req, reason: str, status: int) -> None:
        if not req.finished:
            self.finish(req, FinishReason("abort", message=reason, status=status))

    def guarded(self, req: Req, what: str, fn: Callable[[], T]) -> T | None:
        """`fn()` for `req`; if it raises, end `req` (only) with a 500 naming the cause and return None."""
        try:
            return fn()
        except Exception as e:
            log.exception("request %s: internal error %s", req.rid, what)
            if not req.finished:
                self.fail(req, f"internal error {what}: {e!r}", 500)
            return None

    def _next_plan(self) -> BatchPlan | None:
        """Prefill first; a role that interleaves (a decode's, whose prompts are the few it computes itself) runs
        its batch's next token between two prefill steps."""
        if self.role.interleave_prefill and self.last_mode == ForwardMode.EXTEND and self.decode.running:
            try:
                plan = self.decode_plan()
            except Exception as e:
                return self._fail_all(list(self.decode.running), f"internal error scheduling a decode batch: {e!r}")
            if plan is not None:
                return plan
        try:
            plan = self.prefill.schedule(self.slots_left(), decode_idle=not self.decode.running)
        except Exception as e:
            victims = [*self.prefill.plan.reqs, *([self.prefill.considering] if self.prefill.considering else [])]
            return self._fail_all(victims, f"internal error scheduling a prefill batch: {e!r}")
        if plan is not None:
            return plan
        try:
            plan = self.decode_plan()
        except Exception as e:
            return self._fail_all(list(self.decode.running), f"internal error scheduling a decode batch: {e!r}")
        self._check_starved(plan)
        return plan

    def decode_plan(self) -> BatchPlan | None:
        """A verify when the drafts fit, else one token for every running request, retracting requests until that
        fits (each queued for prefill again); None: nothing runs, or not even one request fits."""
        plan = self.decode.verify_plan()
        if plan is not None:
            return plan
        while not self.decode.fits() and len(self.decode.running) > 1:
            self.retract(self.decode.victim())
        return self.decode.schedule()

    def retract(self, req: Req) -> None:
        """Take a running request out of the decode batch (its KV cached) and queue it for prefill again, ahead
        of the waiting requests of its priority."""
        self.prefill.add_front(self.decode.retract(req))

    def _check_starved(self, plan: BatchPlan | None) -> None:
        """Not even one running request fits the pool: wait while the role has pages on their way back
        (at most --transfer-timeout-s; the role reserves no new pages meanwhile), else end it with 503."""
        if plan is not None or not self.decode.running:
            self.starved_since = None
            return
        now = self.clock()
        if self.starved_since is None:
            self.starved_since = now
        if not self.role.memory_returning() or now - self.starved_since > self.config.transfer_timeout_s:
            self.starved_since = None
            self.fail(self.decode.running[0], "KV cache exhausted", 503)

    def slots_left(self) -> int:
        """Request rows still free: --max-running-requests less the running batch and the rows the role holds."""
        held = sum(1 for r in self.role.requests() if r.req_pool_idx is not None)
        return self.config.max_running_requests - len(self.decode.running) - held

    def _fail_all(self, reqs: list[Req], message: str) -> None:
        log.exception("%s (%d requests)", message, len(reqs))
        for req in dict.fromkeys(reqs):
            if not req.finished:
                self.fail(req, message, 500)

    def _run(self, plan: BatchPlan) -> None:
        self.starting(plan)
        try:
            result = self.runner.run(plan)
        except Exception as e:  # the batch's requests are in no queue now: answer them here
            self.batch_failed(plan, e)
            return
        self.commit(plan, result)

    def starting(self, plan: BatchPlan) -> None:
        """The first half of a step, before its forward."""
        self.last_mode = plan.mode
        for req in plan.reqs if plan.mode == ForwardMode.EXTEND else ():
            req.timeline.mark_once("prefill_start")
        self.step_start = time.perf_counter()

    def batch_failed(self, plan: BatchPlan, error: Exception) -> None:
        self._fail_all(plan.reqs, f"internal error running the batch: {error!r}")

    def commit(self, plan: BatchPlan, result: BatchResult) -> None:
        """The second half of a step: the forward's results into the batch's requests."""
        self.forward_stats.record(plan.mode.value, sum(plan.extend_lens), time.perf_counter() - self.step_start)
        for req in plan.reqs if plan.mode == ForwardMode.EXTEND else ():
            req.timeline.mark("forward_done")
        for i, req in enumerate(plan.reqs):
            self.guarded(req, "committing the batch's results", lambda: self._commit(plan, result, i))

    def _commit(self, plan: BatchPlan, result: BatchResult, i: int) -> None:
        req = plan.reqs[i]
        if result.verified is not None:
            self._commit_verified(req, result.verified[i])
            return
        if plan.mode == ForwardMode.EXTEND or req.kv_computed_len == req.kv_len - 1:
            # a decode step wrote its token's KV for every model; with a draft model lagging behind (a verify
            # accepted all its drafts), what the draft lacks stays uncomputed until its next catch-up
            self.memory.mark_computed(req)
            if self.decode.spec is not None:  # a head's slots lag the target's (common/engine/spec/head_drafter.py)
                req.kv_computed_len = min(req.kv_computed_len, self.decode.spec.drafter.computed_cap(req))
        req.kv_ready = result.kv_ready
        if result.input_logprobs[i] is not None:
            self.output.add_input_logprobs(req, plan.extend_lens[i], result.input_logprobs[i])
        if req.finished:
            return
        sampled = (result.token_ids[i], result.logprobs[i], result.top_logprobs[i]) if plan.sample[i] else None
        if plan.mode == ForwardMode.EXTEND:
            if self.role.on_computed(req, plan.extend_lens[i], sampled) or sampled is None:
                return
            if req.params.max_new_tokens == 0:  # a prefill-only request (scoring): no token
                self.finish(req, FinishReason("length"))
                return
        finish = self.output.commit_token(req, *sampled)
        if finish is not None:
            self.finish(req, finish)
        elif req.status != ReqStatus.RUNNING:
            self.decode.add(req)

    def _commit_verified(self, req: Req, verified: Verified) -> None:
        if req.finished:
            return
        spec = self.decode.spec
        finish = commit_verified(self.output, self.memory, spec.drafter, req, verified)
        if self.spec_stats is not None:
            self.spec_stats.observe(verified)
        if finish is not None:
            self.finish(req, finish)

    # -- the one exit --------------------------------------------------------------------------
    def fail(self, req: Req, message: str, status: int = 502) -> None:
        log.warning("request %s failed: %s", req.rid, message)
        self.finish(req, FinishReason("abort", message=message, status=status))

    def finish(self, req: Req, reason: FinishReason) -> None:
        """Out of every queue, the client answered, then everything the request holds freed (now, or by
        the role once no peer can write into its pages)."""
        if req.finished:
            return
        self.prefill.remove(req)
        self.decode.remove(req)
        if self.grammars is not None:
            self.grammars.remove(req)
        req.status = ReqStatus.FINISHED
        with self._live_lock:
            self._live -= 1
            self.live_tokens -= len(req.prompt_ids)
        try:
            self.output.finish(req, reason)
        except Exception:
            log.exception("request %s: answering the client failed", req.rid)
        free_now = True
        try:
            free_now = self.role.release(req, reason)
        except Exception:
            log.exception("request %s: releasing the role's resources failed", req.rid)
        if free_now:
            self.free(req)

    def free(self, req: Req) -> None:
        """Give back the memory of an ended request (and its adapter's slot)."""
        self.memory.release(req)
        if self.lora is not None:
            self.lora.end(req)

    # -- state ---------------------------------------------------------------------------------
    def tracked_requests(self) -> list[Req]:
        """Every request a queue of this scheduler or its role holds."""
        waiting = self.grammars.waiting if self.grammars is not None else []
        return [*waiting, *self.prefill.requests(), *self.decode.running, *self.role.requests()]

    def num_queued(self) -> int:
        """Requests submitted, not finished and not in the decode batch: in the inbox, waiting for or in
        a prefill forward, or in the role's queues (read from other threads)."""
        return self._live - len(self.decode.running)

    def idle(self) -> bool:
        """No request submitted and unfinished, none held by a queue or the role (a role switch waits for this)."""
        with self._live_lock:
            live = self._live
        return live == 0 and not self.has_work()

    def has_work(self) -> bool:
        waiting = self.grammars is not None and self.grammars.waiting
        return bool(
            waiting or self.prefill.waiting or self.prefill.chunked or self.decode.running or self.role.requests()
        )

    def check_integrity(self) -> PageCounts:
        """Raises on a leak of rows, pages or role resources; returns the page counts."""
        counts = self.memory.check_integrity()
        known = {id(r) for r in self.tracked_requests()}
        strays = [r.rid for r in self.memory.live.values() if id(r) not in known]
        if strays:
            raise MemoryIntegrityError(f"rows held by requests no queue knows: {strays}")
        self.role.check_integrity()
        return counts
