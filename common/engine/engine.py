"""The engine's facade over its parts (common/engine/engine_parts.py, built by common/engine/engine_build.py), what
the HTTP side uses: the scheduler runs on its own thread, and the HTTP side (asyncio) talks to it through
`generate()` (an async stream of OutputEvents), `run_on_scheduler()` (a function executed between two scheduler
steps, as a Future) and `health_problem()` (why /health must answer 503, if it must).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from common.config import ServerConfig
from common.core.request import OutputEvent, Req
from common.core.timeline import report
from common.engine import engine_report
from common.engine.engine_build import build_engine_parts
from common.engine.role import Role, RoleFactory
from common.engine.role_switch import RoleSwitch, bootstrap_address
from common.engine.scheduler_thread import on_scheduler_thread
from common.engine.warmup import warm_up_engine
from common.ranks.launch import FOLLOWER

if TYPE_CHECKING:
    from common.engine.dp_scheduler import DPScheduler
    from common.engine.grammar.backend import GrammarBackend
    from common.engine.metrics import EngineMetrics
    from common.engine.model_runner import ModelRunner
    from common.engine.output import OutputProcessor
    from common.engine.scheduler import Scheduler
    from common.lora.manager import LoraManager
    from common.memory.manager import MemoryManager
    from common.memory.sizing import PoolPlan

T = TypeVar("T")


class Engine:
    def __init__(self, config: ServerConfig, roles: dict[str, RoleFactory] | None = None, follower: str = FOLLOWER):
        """`roles`: how to build each PD role this server may serve, by mode (prefill_node/compose.py,
        decode_node/compose.py; none: monolithic), the one of --disagg-mode built at start-up, the others by a
        role switch (--enable-pd-role-switch); `follower`: the module the follower ranks run at --tp-size > 1
        (common.ranks.launch)."""
        self.parts = p = build_engine_parts(config, roles or {}, follower)
        self.role_switch: RoleSwitch | None = None
        if p.config.enable_pd_role_switch and p.roles.context is not None:
            self.role_switch = RoleSwitch(p.schedulers.top, p.roles.context, p.roles.factories, self.set_mode)

    # -- the parts the HTTP side and the tests read ----------------------------------------------
    @property
    def config(self) -> ServerConfig:
        """The config served: the batch limits derived, disaggregation_mode the role now."""
        return self.parts.config

    @property
    def scheduler(self) -> Scheduler | DPScheduler:
        """The scheduler requests are submitted to (a DPScheduler under DP attention)."""
        return self.parts.schedulers.top

    @property
    def schedulers(self) -> list[Scheduler]:
        return self.parts.schedulers.schedulers

    @property
    def runner(self) -> ModelRunner:
        """DP rank 0's."""
        return self.parts.runners[0]

    @property
    def memory(self) -> MemoryManager:
        """DP rank 0's."""
        return self.parts.memory.first

    @property
    def kv_pool(self) -> Any:
        """KVPool or MLAPool."""
        return self.parts.memory.kv_pool

    @property
    def pool_plan(self) -> PoolPlan:
        return self.parts.memory.pool_plan

    @property
    def context_len(self) -> int:
        return self.parts.memory.context_len

    @property
    def tokenizer(self) -> Any:
        return self.parts.model.tokenizer

    @property
    def hf_config(self) -> Any:
        return self.parts.model.hf_config

    @property
    def model_name(self) -> str:
        return self.parts.model.name

    @property
    def lora(self) -> LoraManager | None:
        """--enable-lora's adapters (common/lora/), else None."""
        return self.parts.runners[0].lora

    @property
    def metrics(self) -> EngineMetrics:
        return self.parts.metrics

    @property
    def grammar(self) -> GrammarBackend | None:
        return self.parts.schedulers.grammar

    @property
    def output(self) -> OutputProcessor:
        return self.parts.schedulers.output

    @property
    def dp_size(self) -> int:
        return len(self.schedulers)

    # -- lifecycle -----------------------------------------------------------------------------
    def warm_up(self) -> float:
        """Build or load every kernel, capture the CUDA graphs and calibrate before serving (warmup.py); returns
        the seconds the kernels and graphs took."""
        p = self.parts
        return warm_up_engine(p.config, p.memory, self.schedulers, p.model.hf_config, p.ranks.dp is not None)

    def start(self) -> None:
        self.parts.schedulers.thread.start()

    def stop(self) -> None:
        p = self.parts
        p.schedulers.thread.stop()
        for memory in p.memory.managers:
            memory.prefix_cache.close()
        if self.grammar is not None:
            self.grammar.close()
        if p.memory.kv_events is not None:
            p.memory.kv_events.close()
        if p.ranks.ranks is not None:
            p.ranks.ranks.stop()

    @property
    def role(self) -> Role:
        """DP rank 0's role: every DP rank's shares its transfer engine and instance."""
        return self.schedulers[0].role

    @property
    def mode(self) -> str:
        """The role this server serves now (--disagg-mode, until a role switch)."""
        return self.config.disaggregation_mode

    def set_mode(self, mode: str) -> None:
        """A role switch installed a role of `mode` (common/engine/role_switch.py; on the scheduler thread)."""
        self.parts.config = self.scheduler.config = self.config.model_copy(update={"disaggregation_mode": mode})
        self.metrics.role = mode

    def bootstrap_address(self) -> str | None:
        """HOST:PORT of the bootstrap registry a prefill registers with; None for other roles."""
        return bootstrap_address(self.config, self.mode)

    @property
    def instance_id(self) -> str | None:
        """The PD role's transfer instance id (what a router passes to decodes), or None."""
        return self.role.instance_id

    def server_info(self) -> dict:
        """What /get_server_info reports (common.engine.engine_report); runs on the scheduler thread and
        raises on a leak."""
        return engine_report.engine_info(self.parts)

    def health_problem(self) -> str | None:
        """Why this server cannot serve right now (/health answers 503 with it), or None."""
        switch = self.role_switch.problem if self.role_switch is not None else None
        thread = self.parts.schedulers.thread
        return self.parts.ranks.fault() or switch or thread.health_problem() or self.role.health_problem()

    # -- API for the HTTP side -----------------------------------------------------------------
    def submit(self, req: Req) -> None:
        self.scheduler.submit(req)

    def abort(self, req: Req, reason: str = "aborted by client", status: int = 499) -> None:
        self.scheduler.abort(req, reason, status)

    def run_on_scheduler(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        return on_scheduler_thread(self.scheduler, fn)

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
