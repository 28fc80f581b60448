"""Builds model, pools and scheduler from one ServerConfig and runs the scheduler on its own thread.

The HTTP side (asyncio) talks to it through `generate()` (an async stream of OutputEvents),
`run_on_scheduler()` (a function executed between two scheduler steps, as a Future) and
`health_problem()` (why /health must answer 503, if it must).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
from transformers import AutoTokenizer

from common.attention.choice import choose_attention_backend
from common.config import ServerConfig
from common.core.request import OutputEvent, Req
from common.core.timeline import report
from common.engine import engine_report, host_tier
from common.engine.dp_scheduler import DPScheduler
from common.engine.engine_setup import (
    batch_limits,
    context_len_for,
    eos_token_ids,
    kv_store_namespace,
    make_grammar_backend,
    make_kv_event_publisher,
)
from common.engine.metrics import EngineMetrics
from common.engine.model_runner import ModelRunner
from common.engine.output import OutputProcessor
from common.engine.role import Role, RoleFactory
from common.engine.role_switch import RoleSwitch
from common.engine.scheduler import Scheduler
from common.engine.scheduler_thread import SchedulerThread
from common.engine.spec.commit import SpecStats
from common.engine.spec.factory import make_drafter, speculative_descriptor
from common.engine.spec.plan import SpecPlanner
from common.engine.warmup import use_kernel_cache, warm_up_engine
from common.memory.allocator import PagedAllocator
from common.memory.manager import MemoryManager
from common.memory.prefix_cache import make_prefix_cache
from common.memory.req_to_token_pool import ReqToTokenPool
from common.memory.static_reserve import REQ_SPARE_ROWS
from common.model.identity import model_identity
from common.model.loader import load_hf_config, resolve_model_dir
from common.model.locate import display_name
from common.model.registry import attention_spec, model_class
from common.parallel.group import SINGLE
from common.parallel.partition import check_parallel
from common.quant.scheme import describe_weights, detect_scheme
from common.ranks.launch import FOLLOWER
from common.ranks.leader import DPForward, ExpertRebalancer, LeaderModel, idle_batch
from common.ranks.rank_model import RankModel, build_rank_model, describe_rank, rank_report
from common.ranks.ranks import Ranks
from common.wire.kv_layout import experts_layout, kv_layout

log = logging.getLogger(__name__)
T = TypeVar("T")


class Engine:
    def __init__(self, config: ServerConfig, make_role: RoleFactory | None = None, follower: str = FOLLOWER):
        """`make_role(engine)` builds the PD roles once the schedulers exist (None: monolithic); `follower` is the
        module the follower ranks run at --tp-size > 1 (common.ranks.launch)."""
        self.config, self.follower = config, follower
        self.model_dir: Path = resolve_model_dir(config.model)
        self.hf_config = load_hf_config(self.model_dir)
        self.weights = describe_weights(detect_scheme(self.model_dir, self.hf_config, config.quantization))
        spec = attention_spec(self.hf_config)
        self.attention_backend, warning = choose_attention_backend(
            config.attention_backend,
            config.device,
            config.torch_dtype_name,
            spec.head_dim if spec.kind == "mha" else None,
        )  # before loading weights: a refusal comes at once
        if warning:  # "auto" could not take FlashInfer: every rank builds the torch backend
            log.warning("%s", warning)
            self.config = config = config.model_copy(update={"attention_backend": self.attention_backend})
        torch.manual_seed(config.seed)
        self.model_id = model_identity(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model_name = config.served_model_name or display_name(config.model)
        self.dtype = getattr(torch, config.torch_dtype_name)
        self.metrics = EngineMetrics(config.disaggregation_mode)
        use_kernel_cache(config.kernel_cache_dir)  # before FlashInfer is imported
        self.ranks = self._start_ranks()
        tp = self.ranks.tp if self.ranks else SINGLE
        built = build_rank_model(config, self.model_dir, self.hf_config, self.dtype, tp)
        self.rank_reports = tp.all_gather_objects(rank_report(0, built))
        # a PD follower's transfer engine and pool (transfer.rank_agent), for the role's KV manager
        self.followers_transfer = [r.pop("transfer") for r in self.rank_reports[1:] if "transfer" in r]
        if self.ranks is not None:
            self.ranks.serving = True
            log.info("tp size %d:\n  %s", tp.size, "\n  ".join(describe_rank(r) for r in self.rank_reports))
        self.pool_plan, self.kv_pool, self.reserved = built.pool_plan, built.kv_pool, built.reserved
        self.model = built.model
        log.info("%s", self.pool_plan.describe())
        self.context_len = context_len_for(self.hf_config, config, self.pool_plan)
        self.config = config = batch_limits(config, self.pool_plan, self.context_len, self.hf_config.vocab_size)
        self.kv_events = make_kv_event_publisher(config, self.metrics)
        self.dp_size = config.tp_size if config.enable_dp_attention else 1
        self.memories = [self._make_memory() for _ in range(self.dp_size)]  # DP attention: one per DP rank
        self.memory = self.memories[0]
        if config.enable_hierarchical_cache:
            log.info("%s", host_tier.summary(self.memory.prefix_cache).removeprefix("; "))
        eos_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.output = OutputProcessor(self.tokenizer, eos_ids, self.context_len, self.metrics)
        self.drafter = make_drafter(built, config, self.memory.req_pool.req_to_token)
        # in the KV layout a PD peer must match
        self.speculative = speculative_descriptor(config, built)
        # NEXTN, EAGLE, EAGLE3: the prompt's last hidden state crosses PD in the aux record
        self.hidden_handoff = self.drafter if self.drafter is not None and self.drafter.needs_hidden else None
        self.aux_hidden_bytes = self.hidden_handoff.hidden_bytes if self.hidden_handoff is not None else 0
        runners = self._runners(built, frozenset(eos_ids))
        self.runner = runners[0]
        woken = threading.Event()
        self.schedulers = [
            Scheduler(config, runner, memory, self.output, woken=woken, dp_rank=d)
            for d, (runner, memory) in enumerate(zip(runners, self.memories))
        ]
        self.scheduler = (
            self.schedulers[0] if self.dp is None else DPScheduler(self.schedulers, self.dp, config.lb_method)
        )
        if self.drafter is not None:
            self._start_speculative()
        self.grammar = make_grammar_backend(config, self.hf_config.vocab_size, self.tokenizer, eos_ids, self.schedulers)
        if make_role is not None:  # one role per DP rank's scheduler
            for scheduler, role in zip(self.schedulers, make_role(self)):
                scheduler.role = role
        self.thread = SchedulerThread(self.scheduler, config.watchdog_timeout_s)
        self.role_switch: RoleSwitch | None = None  # --enable-pd-role-switch: set by the server's composition
        engine_report.register_engine_gauges(self)

    def _start_speculative(self) -> None:
        """Decode steps verify drafts (common/engine/spec/): the planner, the metrics, the answers' meta."""
        k = self.config.speculative_draft_len
        self.scheduler.decode.spec = SpecPlanner(self.drafter, k, self.memory, self.context_len)
        self.scheduler.spec_stats = SpecStats(self.metrics, k)
        self.output.speculative = True
        log.info("speculative decoding: %s, %d draft tokens per verify", self.drafter.describe(), k)

    def _start_ranks(self) -> Ranks | None:
        """The follower ranks, started and joined (after the sizes were checked), or None at TP 1."""
        hf, c = self.hf_config, self.config
        spec, model = attention_spec(hf), model_class(hf)  # MLA: one latent "KV head", replicated on every rank
        check_parallel(
            c.tp_size,
            c.ep_size,
            c.enable_dp_attention,
            c.ep_num_redundant_experts,
            (spec.q_heads, spec.kv_heads),
            model.tp_divided(hf),
            model.experts_of(hf),
        )
        return Ranks(c, self.follower) if c.tp_size > 1 else None

    def _make_memory(self) -> MemoryManager:
        """Request rows, page allocator and prefix cache over the pool's pages (a DP rank's, under DP attention)."""
        c = self.config
        req_pool = ReqToTokenPool(c.max_running_requests + REQ_SPARE_ROWS, self.context_len + c.page_size, c.device)
        allocator = PagedAllocator(self.pool_plan.num_pages, c.page_size, c.device)
        namespace = kv_store_namespace(c, self.kv_pool.buffer, self.model_id, self.model_dir)
        prefix = make_prefix_cache(c, allocator, self.kv_pool, self.kv_events, namespace, lambda: self.scheduler.wake())
        return MemoryManager(req_pool, allocator, prefix, c.page_size, reuse_cut=c.drafts_from_hidden)

    def _runners(self, built: RankModel, eos_ids: frozenset[int]) -> list[ModelRunner]:
        """The model runner (rank 0's model sends each batch to the other ranks first), or one per DP rank,
        whose batches run together (`dp`: DPForward, else None)."""
        c, device = self.config, self.config.device
        check = self.ranks.check_step if self.ranks is not None else (lambda: None)
        self.rebalancer = None
        if c.enable_eplb:
            self.rebalancer = ExpertRebalancer(self.ranks, built.model, c.eplb_rebalance_num_iterations)
        self.dp: DPForward | None = None
        if self.dp_size == 1:
            model = built.model if self.ranks is None else LeaderModel(built.model, self.ranks, self.rebalancer)
            req_to_token = self.memory.req_pool.req_to_token
            return [ModelRunner(model, built.attn, req_to_token, device, eos_ids, self.drafter, check)]
        idle = idle_batch(self.memory.req_pool.req_to_token, c.page_size, device)
        self.dp = DPForward(built.model, built.attn, self.ranks, idle, self.rebalancer)
        return [
            ModelRunner(
                built.model,
                built.attn,
                m.req_pool.req_to_token,
                device,
                eos_ids,
                check_step=check,
                forward=partial(self.dp.forward_one, d),
            )
            for d, m in enumerate(self.memories)
        ]

    # -- lifecycle -----------------------------------------------------------------------------
    def warm_up(self) -> float:
        """Build or load every kernel, capture the CUDA graphs and calibrate before serving (warmup.py); returns
        the seconds the kernels and graphs took."""
        return warm_up_engine(self)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.thread.stop()
        for memory in self.memories:
            memory.prefix_cache.close()
        if self.grammar is not None:
            self.grammar.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.ranks is not None:
            self.ranks.stop()

    @property
    def role(self) -> Role:
        """DP rank 0's role: every DP rank's shares its transfer engine and instance."""
        return self.schedulers[0].role

    @property
    def mode(self) -> str:
        """The role this server serves now (--disaggregation-mode, until a role switch)."""
        return self.config.disaggregation_mode

    def set_mode(self, mode: str) -> None:
        """A role switch installed a role of `mode` (common/engine/role_switch.py; on the scheduler thread)."""
        self.config = self.scheduler.config = self.config.model_copy(update={"disaggregation_mode": mode})
        self.metrics.role = mode

    def bootstrap_address(self) -> str | None:
        """HOST:PORT of the bootstrap registry a prefill registers with (its embedded one, or --bootstrap-url's);
        None for other roles."""
        if self.mode != "prefill":
            return None
        if self.config.bootstrap_url:
            return self.config.bootstrap_url.split("://", 1)[-1].rstrip("/")
        return f"{self.config.public_host}:{self.config.bootstrap_port}"

    @property
    def instance_id(self) -> str | None:
        """The PD role's transfer instance id (what a router passes to decodes), or None."""
        return self.role.instance_id

    def server_info(self) -> dict:
        """What /get_server_info reports (common.engine.engine_report); runs on the scheduler thread and
        raises on a leak."""
        return engine_report.engine_info(self)

    def kv_layout(self, kv_heads: int) -> dict:
        """This server's KV layout (common.wire.kv_layout) for a model of `kv_heads` as the layout counts them."""
        c, experts = self.config, model_class(self.hf_config).experts_of(self.hf_config)
        moe = experts_layout(experts[0] if experts else 0, c.ep_size, c.ep_num_redundant_experts)
        return kv_layout(
            self.kv_pool,
            c.transfer_backend,
            self.model_id,
            c.tp_size,
            kv_heads,
            c.disaggregation_enable_kv_checksum,
            self.speculative,
            self.dp_size,
            moe,
            self.weights,
        )

    def health_problem(self) -> str | None:
        """Why this server cannot serve right now (/health answers 503 with it), or None."""
        rank_fault = self.ranks.fault if self.ranks is not None else None
        switch = self.role_switch.problem if self.role_switch is not None else None
        return rank_fault or switch or self.thread.health_problem() or self.role.health_problem()

    # -- API for the HTTP side -----------------------------------------------------------------
    def submit(self, req: Req) -> None:
        self.scheduler.submit(req)

    def abort(self, req: Req, reason: str = "aborted by client", status: int = 499) -> None:
        self.scheduler.abort(req, reason, status)

    def run_on_scheduler(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

        self.scheduler.run_on_scheduler(call)
        return fut

    async def generate(self, req: Req, stream: bool = True) -> AsyncIterator[OutputEvent]:
        """Submit `req` and yield its events (with `stream` False, all of them once it ended); leaving
        early (client gone) aborts it."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[OutputEvent] = asyncio.Queue()
        req.sink = event_sink(loop, events, stream)
        req.arrival_time = time.monotonic()
        req.timeline.mark("arrival", req.arrival_time)
        self.submit(req)
        finished = streamed = False
        try:
            while not finished:
                event = await events.get()
                finished = event.finish is not None
                if event.token_ids and not streamed:
                    streamed = True
                    req.timeline.mark("first_token_streamed")
                yield event
        finally:
            if not finished:
                self.abort(req)
            report(req.rid, req.arrival_time, req.timeline, self.metrics.spans)


def event_sink(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, stream: bool) -> Callable[[OutputEvent], None]:
    """How the scheduler thread hands a request's events to its HTTP handler: each at once when it
    streams; otherwise all together with the last one, so a JSON answer wakes the event loop once per
    request instead of once per token (a thread switch and a syscall each)."""
    if stream:
        return lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
    held: list[OutputEvent] = []

    def hold(ev: OutputEvent) -> None:
        held.append(ev)
        if ev.finish is not None:  # the last event of a request
            loop.call_soon_threadsafe(lambda: [events.put_nowait(e) for e in held])

    return hold
