"""The typed parts an Engine is built from, each made from the ones before it (common/engine/engine_build.py):
what was loaded (`ModelParts`), the ranks (`RankParts`), the memory (`MemoryParts`), one model runner per DP
rank, the schedulers (`SchedulerParts`) and the PD roles (`RoleParts`). Warm-up, graph capture and the engine
report take the parts they read; `Engine` (common/engine/engine.py) is the facade over them that the HTTP layer
uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import PretrainedConfig

from common.config import ServerConfig
from common.engine.metrics import EngineMetrics
from common.engine.model_runner import ModelRunner
from common.engine.output import OutputProcessor
from common.engine.role import RoleContext, RoleFactory
from common.engine.scheduler import Scheduler
from common.engine.scheduler_thread import SchedulerThread
from common.memory.manager import MemoryManager
from common.memory.sizing import PoolPlan

if TYPE_CHECKING:
    from common.engine.dp_scheduler import DPScheduler
    from common.engine.grammar.backend import GrammarBackend
    from common.engine.kv_event_publisher import KVEventPublisher
    from common.engine.spec.drafter import Drafter
    from common.memory.static_reserve import StaticReserve
    from common.ranks.leader import DPForward, ExpertRebalancer
    from common.ranks.ranks import Ranks


@dataclass(frozen=True)
class ModelParts:
    """The model as start-up found it: where, its config, identity, tokenizer, served name and EOS ids."""

    model_dir: Path
    hf_config: PretrainedConfig
    model_id: str  # common.model.identity.model_identity
    tokenizer: Any
    name: str  # --served-model-name, else the model's display name
    eos_ids: frozenset[int]


@dataclass(frozen=True)
class RankParts:
    """The ranks of the TP group (`ranks` None at TP 1) and what rank 0 holds of the forward."""

    ranks: Ranks | None
    reports: list[dict]  # every rank's report (common.ranks.rank_model.rank_report), rank 0 first
    followers_transfer: list  # a PD follower's transfer engine and pool each (transfer.rank_agent)
    model: Any  # rank 0's model
    rebalancer: ExpertRebalancer | None  # --enable-eplb
    dp: DPForward | None  # DP attention's one forward for every DP rank's batch

    def fault(self) -> str | None:
        """Why a follower rank failed, or None."""
        return self.ranks.fault if self.ranks is not None else None


@dataclass(frozen=True)
class MemoryParts:
    """The KV pool, its plan and what was set aside beside it, the context served, and one MemoryManager per DP
    rank over the pool's pages."""

    kv_pool: Any  # KVPool or MLAPool
    pool_plan: PoolPlan
    reserved: StaticReserve
    context_len: int
    managers: list[MemoryManager]
    kv_events: KVEventPublisher | None

    @property
    def first(self) -> MemoryManager:
        """DP rank 0's (the only one without DP attention)."""
        return self.managers[0]


@dataclass(frozen=True)
class SchedulerParts:
    """One Scheduler per DP rank, `top` the one requests are submitted to (a DPScheduler over them under DP
    attention), what they share (the output processor, the grammar backend, the drafter) and their thread."""

    schedulers: list[Scheduler]
    top: Scheduler | DPScheduler
    output: OutputProcessor
    grammar: GrammarBackend | None
    drafter: Drafter | None
    speculative: str  # the KV layout's `speculative` field (common.engine.spec.factory.speculative_descriptor)
    thread: SchedulerThread


@dataclass(frozen=True)
class RoleParts:
    """The PD roles' factories, by mode (none: monolithic), and the context they are composed from."""

    factories: dict[str, RoleFactory]
    context: RoleContext | None


@dataclass
class EngineParts:
    """Everything an engine is; `config` has the attention backend resolved and the batch limits derived, and its
    disaggregation_mode follows a role switch (Engine.set_mode)."""

    config: ServerConfig
    metrics: EngineMetrics
    model: ModelParts
    ranks: RankParts
    memory: MemoryParts
    runners: list[ModelRunner]
    schedulers: SchedulerParts
    roles: RoleParts
