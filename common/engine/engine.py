"""Builds model, pools and scheduler from one ServerConfig and runs the scheduler on its own thread.

The HTTP side (asyncio) talks to it through `generate()` (an async stream of OutputEvents) and
`run_on_scheduler()` (a function executed between two scheduler steps).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Callable, TypeVar

import torch
from transformers import AutoTokenizer, GenerationConfig

from common.attention.base import make_attention_backend
from common.config import ServerConfig
from common.engine.metrics import EngineMetrics
from common.engine.model_runner import ModelRunner
from common.engine.output import OutputProcessor
from common.engine.request import FinishReason, OutputEvent, Req
from common.engine.scheduler import Scheduler
from common.memory.allocator import PagedAllocator
from common.memory.kv_pool import KVPool, kv_bytes_per_token
from common.memory.manager import KVCacheManager
from common.memory.prefix_cache import NoPrefixCache
from common.memory.radix_cache import RadixCache
from common.memory.req_to_token_pool import ReqToTokenPool
from common.memory.sizing import PoolPlan, plan_context_len, plan_kv_pool
from common.model.rotary import head_dim_of
from common.model.loader import (
    display_name,
    load_hf_config,
    load_model,
    resolve_model_dir,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
SchedulerFactory = Callable[["Engine"], Scheduler]


def monolithic_scheduler(engine: "Engine") -> Scheduler:
    return Scheduler(engine.config, engine.runner, engine.kv, engine.output)


class Engine:
    def __init__(self, config: ServerConfig, scheduler_factory: SchedulerFactory = monolithic_scheduler):
        self.config = config
        torch.manual_seed(config.seed)
        self.model_dir: Path = resolve_model_dir(config.model)
        self.hf_config = load_hf_config(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model_name = config.served_model_name or display_name(config.model)
        self.dtype = getattr(torch, config.torch_dtype_name)
        self.metrics = EngineMetrics()
        model = load_model(self.model_dir, self.hf_config, self.dtype, config.device)  # first: the pool gets what is left
        head_dim = head_dim_of(self.hf_config)
        self.pool_plan = self._plan_pool(head_dim)
        self.context_len = self._context_len()
        num_pages = self.pool_plan.num_pages
        self.kv_pool = KVPool(
            self.hf_config.num_hidden_layers, num_pages, config.page_size,
            self.hf_config.num_key_value_heads, head_dim, self.dtype, config.device,
        )
        req_pool = ReqToTokenPool(config.max_running_requests + 8, self.context_len + config.page_size, config.device)
        allocator = PagedAllocator(num_pages, config.page_size, config.device)
        prefix = NoPrefixCache(allocator, config.page_size) if config.disable_radix_cache else RadixCache(allocator, config.page_size)
        self.kv = KVCacheManager(req_pool, allocator, prefix, config.page_size)
        attn = make_attention_backend(
            config.attention_backend, config.device, self.kv_pool, self.hf_config.num_attention_heads, head_dim, head_dim**-0.5
        )
        self.runner = ModelRunner(model, attn, req_pool.req_to_token, config.device)
        self.output = OutputProcessor(self.tokenizer, self._eos_ids(), self.context_len, self.metrics)
        self.scheduler = scheduler_factory(self)
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._register_gauges()

    def _plan_pool(self, head_dim: int) -> PoolPlan:
        c = self.config
        per_token = kv_bytes_per_token(self.hf_config.num_hidden_layers, self.hf_config.num_key_value_heads, head_dim, self.dtype)
        memory = torch.cuda.mem_get_info() if c.device == "cuda" else None  # (free, total) after the weights
        plan = plan_kv_pool(c.page_size, per_token, c.max_total_tokens, memory, c.mem_fraction_static)
        log.info("%s", plan.describe())
        return plan

    def _context_len(self) -> int:
        model_max = getattr(self.hf_config, "max_position_embeddings", 4096)
        context_len, warning = plan_context_len(model_max, self.config.context_length, self.pool_plan)
        if warning:
            log.warning("%s", warning)
        return context_len

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        try:
            gen = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            ids.update(gen if isinstance(gen, list) else [gen] if gen is not None else [])
        except OSError:
            pass
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _register_gauges(self) -> None:
        m, s = self.metrics, self.scheduler
        m.gauge("tandem_num_running_reqs", "requests decoding", lambda: len(s.running))
        m.gauge("tandem_num_queue_reqs", "requests waiting for prefill", lambda: len(s.waiting))
        m.gauge("tandem_kv_pages_total", "KV pages", lambda: self.pool_plan.num_pages)
        m.gauge("tandem_kv_pages_free", "KV pages free", lambda: self.kv.allocator.available_pages())

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stop:
            try:
                worked = sched.step()
            except Exception as e:  # a bug must end the affected requests, not the server
                log.exception("scheduler step failed")
                self._fail_all(f"internal error in the scheduler: {e!r}")
                worked = False
            if not worked:
                self._wake.wait(0.002 if sched.has_work() else 0.5)
                self._wake.clear()

    def _fail_all(self, message: str) -> None:
        s = self.scheduler
        for req in s.tracked_requests():
            if not req.finished:
                s.finish(req, FinishReason("abort", message=message, status=500))

    # -- API for the HTTP side -----------------------------------------------------------------
    def submit(self, req: Req) -> None:
        self.scheduler.submit(req)
        self._wake.set()

    def abort(self, req: Req, reason: str = "aborted by client", status: int = 499) -> None:
        self.scheduler.abort(req, reason, status)
        self._wake.set()

    def run_on_scheduler(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

        self.scheduler.call(call)
        self._wake.set()
        return fut

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.run_on_scheduler(fn))

    async def generate(self, req: Req) -> AsyncIterator[OutputEvent]:
        """Submit `req` and yield its events; leaving early (client gone) aborts it."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[OutputEvent] = asyncio.Queue()
        req.sink = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        req.arrival_time = time.monotonic()
        self.submit(req)
        finished = False
        try:
            while not finished:
                event = await events.get()
                finished = event.finish is not None
                yield event
        finally:
            if not finished:
                self.abort(req)
