"""Start-up: an Engine's parts (common/engine/engine_parts.py) from one ServerConfig, in order, each from the ones
before it: the model's files and tokenizer, the ranks and rank 0's model and KV pool, the memory, the runners, the
schedulers, then the PD roles, composed from a RoleContext once the schedulers exist. What each step derives from
the config and the model is in common/engine/engine_setup.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from transformers import AutoTokenizer, PretrainedConfig

from common.attention.choice import choose_attention_backend
from common.config import ServerConfig
from common.engine import host_tier
from common.engine.dp_scheduler import DPScheduler
from common.engine.engine_parts import EngineParts, MemoryParts, ModelParts, RankParts, RoleParts, SchedulerParts
from common.engine.engine_report import register_engine_gauges
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
from common.engine.role import RoleContext, RoleFactory, SchedulerView
from common.engine.scheduler import Scheduler
from common.engine.scheduler_thread import SchedulerThread
from common.engine.spec.commit import SpecStats
from common.engine.spec.drafter import Drafter
from common.engine.spec.factory import make_drafter, speculative_descriptor
from common.engine.spec.plan import SpecPlanner
from common.engine.warmup import use_kernel_cache
from common.lora.manager import LoraManager
from common.lora.setup import read_lora
from common.memory.allocator import PagedAllocator
from common.memory.manager import MemoryManager
from common.memory.prefix_cache_factory import make_prefix_cache
from common.memory.req_to_token_pool import ReqToTokenPool
from common.memory.static_reserve import REQ_SPARE_ROWS
from common.model.identity import model_identity
from common.model.loader import load_hf_config, resolve_model_dir
from common.model.locate import display_name
from common.model.registry import attention_spec, model_class
from common.parallel.group import SINGLE
from common.parallel.partition import check_parallel
from common.quant.scheme import describe_weights, detect_scheme
from common.ranks.leader import DPForward, ExpertRebalancer, LeaderModel, idle_batch
from common.ranks.rank_model import RankModel, build_rank_model, describe_rank, rank_report
from common.ranks.ranks import Ranks
from common.wire.kv_layout import experts_layout, kv_layout, model_kv_heads

log = logging.getLogger(__name__)


def build_engine_parts(config: ServerConfig, factories: dict[str, RoleFactory], follower: str) -> EngineParts:
    """Every part of an engine; `factories`: the PD roles this server may serve, by mode (none: monolithic);
    `follower`: the module the follower ranks run at --tp-size > 1 (common.ranks.launch)."""
    model = model_parts(config)
    config = with_attention_backend(config, model.hf_config)  # before loading weights: a refusal comes at once
    lora_setup = read_lora(config, model.hf_config)  # --enable-lora's adapters, read and checked before the weights
    torch.manual_seed(config.seed)
    metrics = EngineMetrics(config.disaggregation_mode)
    use_kernel_cache(config.kernel_cache_dir)  # before FlashInfer is imported
    ranks = start_ranks(config, model.hf_config, follower)
    built, reports, followers = build_rank_zero(config, model, ranks)
    lora = lora_setup.manager(built.model) if lora_setup is not None else None  # its slots split as rank 0's shard
    context_len = context_len_for(model.hf_config, config, built.pool_plan)
    config = batch_limits(config, built.pool_plan, context_len, model.hf_config.vocab_size)
    woken = threading.Event()  # what the scheduler thread waits on (a store's finished work sets it too)
    memory = memory_parts(config, model, built, context_len, metrics, woken.set, adapter_namer(lora))
    drafter = make_drafter(built, config, memory.first.req_pool.req_to_token)
    runners, rebalancer, dp = model_runners(config, ranks, built, memory, model.eos_ids, drafter, lora)
    rank_parts = RankParts(ranks, reports, followers, built.model, rebalancer, dp)
    speculative = speculative_descriptor(config, built)  # in the KV layout a PD peer must match
    schedulers = scheduler_parts(config, model, memory, runners, rank_parts, drafter, speculative, metrics, woken)
    roles = role_parts(config, factories, model, memory, rank_parts, schedulers, metrics)
    register_engine_gauges(metrics, memory, schedulers.schedulers)
    return EngineParts(config, metrics, model, rank_parts, memory, runners, schedulers, roles)


def model_parts(config: ServerConfig) -> ModelParts:
    """The model's directory, config, identity, tokenizer, served name and EOS ids (no weights yet)."""
    model_dir: Path = resolve_model_dir(config.model, quantization=config.quantization)
    hf_config = load_hf_config(model_dir)
    detect_scheme(model_dir, hf_config, config.quantization)  # an unsupported one refused before any weight loads
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    name = config.served_model_name or display_name(config.model)
    eos_ids = frozenset(eos_token_ids(model_dir, tokenizer))
    return ModelParts(model_dir, hf_config, model_identity(model_dir), tokenizer, name, eos_ids)


def with_attention_backend(config: ServerConfig, hf_config: PretrainedConfig) -> ServerConfig:
    """The config with the attention backend every rank builds ("auto" resolved; a warning when it could not take
    FlashInfer)."""
    spec = attention_spec(hf_config)
    head_dim = spec.head_dim if spec.kind == "mha" else None
    backend, warning = choose_attention_backend(
        config.attention_backend, config.device, config.torch_dtype_name, head_dim
    )
    if not warning:
        return config
    log.warning("%s", warning)
    return config.model_copy(update={"attention_backend": backend})


def start_ranks(c: ServerConfig, hf: PretrainedConfig, follower: str) -> Ranks | None:
    """The follower ranks, started and joined (after the sizes were checked), or None at TP 1."""
    spec, model = attention_spec(hf), model_class(hf)  # MLA: one latent "KV head", replicated on every rank
    heads = (spec.q_heads, spec.kv_heads)
    experts = model.experts_of(hf)
    check_parallel(
        c.tp_size, c.ep_size, c.enable_dp_attention, c.ep_num_redundant_experts, heads, model.tp_divided(hf), experts
    )
    return Ranks(c, follower) if c.tp_size > 1 else None


def build_rank_zero(config: ServerConfig, model: ModelParts, ranks: Ranks | None) -> tuple[RankModel, list, list]:
    """Rank 0's model, KV pool and attention (every rank builds its own at once), every rank's report, and a PD
    follower's transfer engine and pool each (taken out of its report: transfer.rank_agent)."""
    tp = ranks.tp if ranks else SINGLE
    dtype = getattr(torch, config.torch_dtype_name)
    built = build_rank_model(config, model.model_dir, model.hf_config, dtype, tp)
    reports = tp.all_gather_objects(rank_report(0, built))
    followers = [r.pop("transfer") for r in reports[1:] if "transfer" in r]
    if ranks is not None:
        ranks.serving = True
        log.info("tp size %d:\n  %s", tp.size, "\n  ".join(describe_rank(r) for r in reports))
    log.info("%s", built.pool_plan.describe())
    return built, reports, followers


def adapter_namer(lora: LoraManager | None) -> Callable[[int], str | None]:
    """A lora_id's adapter name, as the server numbers its adapters now (None: no such adapter): what keys an
    adapter's pages in KV events and the store by its name (the prefix cache keys them by lora_id)."""

    def name(lora_id: int) -> str | None:
        ids = lora.ids if lora is not None else {}
        return next((n for n, i in ids.items() if i == lora_id), None)

    return name


def memory_parts(
    c: ServerConfig,
    model: ModelParts,
    built: RankModel,
    context_len: int,
    metrics: EngineMetrics,
    wake,
    adapter_name: Callable[[int], str | None] | None = None,
) -> MemoryParts:
    """Request rows, page allocator and prefix cache over the pool's pages: one MemoryManager, or one per DP rank
    under DP attention (each over its rank's pool). `wake` wakes the scheduler when a store's work ends;
    `adapter_name` names a LoRA adapter by its lora_id (KV events and store keys digest its name)."""
    adapter_name = adapter_name or adapter_namer(None)
    kv_events = make_kv_event_publisher(c, metrics, adapter_name)
    namespace = kv_store_namespace(c, built.kv_pool.buffer, model.model_id, model.model_dir)
    managers = []
    for _ in range(c.tp_size if c.enable_dp_attention else 1):
        req_pool = ReqToTokenPool(c.max_running_requests + REQ_SPARE_ROWS, context_len + c.page_size, c.device)
        allocator = PagedAllocator(built.pool_plan.num_pages, c.page_size, c.device)
        prefix = make_prefix_cache(c, allocator, built.kv_pool, kv_events, namespace, wake, adapter_name)
        managers.append(MemoryManager(req_pool, allocator, prefix, c.page_size, reuse_cut=c.drafts_from_hidden))
    if c.enable_hierarchical_cache:
        log.info("%s", host_tier.summary(managers[0].prefix_cache).removeprefix("; "))
    return MemoryParts(built.kv_pool, built.pool_plan, built.reserved, context_len, managers, kv_events)


def model_runners(
    c: ServerConfig,
    ranks: Ranks | None,
    built: RankModel,
    memory: MemoryParts,
    eos_ids: frozenset[int],
    drafter: Drafter | None,
    lora: LoraManager | None = None,
) -> tuple[list[ModelRunner], ExpertRebalancer | None, DPForward | None]:
    """The model runner (rank 0's model sends each batch to the other ranks first), or one per DP rank, whose
    batches run together (the DPForward returned); and --enable-eplb's rebalancer. `lora`: --enable-lora's
    adapters (one runner: LoRA refuses DP attention)."""
    check = ranks.check_step if ranks is not None else (lambda: None)
    rebalancer = ExpertRebalancer(ranks, built.model, c.eplb_rebalance_num_iterations) if c.enable_eplb else None
    dp, first = None, memory.first.req_pool.req_to_token
    if len(memory.managers) == 1:
        model = built.model if ranks is None else LeaderModel(built.model, ranks, rebalancer)
        runners = [ModelRunner(model, built.attn, first, c.device, eos_ids, drafter, check, lora=lora)]
    else:
        dp = DPForward(built.model, built.attn, ranks, idle_batch(first, c.page_size, c.device), rebalancer)
        runners = [
            ModelRunner(
                built.model,
                built.attn,
                m.req_pool.req_to_token,
                c.device,
                eos_ids,
                check_step=check,
                forward=partial(dp.forward_one, d),
            )
            for d, m in enumerate(memory.managers)
        ]
    return runners, rebalancer, dp


def scheduler_parts(
    c: ServerConfig,
    model: ModelParts,
    memory: MemoryParts,
    runners: list[ModelRunner],
    ranks: RankParts,
    drafter: Drafter | None,
    speculative: str,
    metrics: EngineMetrics,
    woken: threading.Event,
) -> SchedulerParts:
    """One scheduler per DP rank (stepped by one thread, all waking on `woken`), speculative decoding and the
    grammars set up on them."""
    output = OutputProcessor(model.tokenizer, set(model.eos_ids), memory.context_len, metrics)
    schedulers = [
        Scheduler(c, runner, m, output, woken=woken, dp_rank=d, lora=runner.lora)
        for d, (runner, m) in enumerate(zip(runners, memory.managers))
    ]
    top = schedulers[0] if ranks.dp is None else DPScheduler(schedulers, ranks.dp, c.lb_method)
    if drafter is not None:  # decode steps verify drafts (common/engine/spec/)
        k = c.speculative_draft_len
        top.decode.spec = SpecPlanner(drafter, k, memory.first, memory.context_len)
        top.spec_stats = SpecStats(metrics, k)
        output.speculative = True
        log.info("speculative decoding: %s, %d draft tokens per verify", drafter.describe(), k)
    vocab, eos = model.hf_config.vocab_size, set(model.eos_ids)
    grammar = make_grammar_backend(c, vocab, model.tokenizer, eos, schedulers)
    thread = SchedulerThread(top, c.watchdog_timeout_s)
    return SchedulerParts(schedulers, top, output, grammar, drafter, speculative, thread)


def role_parts(
    c: ServerConfig,
    factories: dict[str, RoleFactory],
    model: ModelParts,
    memory: MemoryParts,
    ranks: RankParts,
    sp: SchedulerParts,
    metrics: EngineMetrics,
) -> RoleParts:
    """The PD roles of --disagg-mode, one per DP rank's scheduler, composed from the finished parts; none for a
    monolithic server."""
    if c.disaggregation_mode not in factories:
        return RoleParts(factories, None)
    kv_heads = model_kv_heads(memory.kv_pool, model.hf_config, c.tp_size)
    drafter = sp.drafter
    handoff = drafter if drafter is not None and drafter.needs_hidden else None  # NEXTN, EAGLE, EAGLE3
    context = RoleContext(
        config=c,
        views=[SchedulerView(s) for s in sp.schedulers],
        kv_pool=memory.kv_pool,
        kv_heads=kv_heads,
        kv_layout=server_kv_layout(c, model, memory, sp.speculative, kv_heads),
        vocab_size=model.hf_config.vocab_size,
        followers_transfer=ranks.followers_transfer,
        hidden_handoff=handoff,
        aux_hidden_bytes=handoff.hidden_bytes if handoff is not None else 0,
        metrics=metrics,
        wake_scheduler=sp.top.wake,
        rank_fault=ranks.fault,
    )
    for scheduler, role in zip(sp.schedulers, factories[c.disaggregation_mode](context)):
        scheduler.role = role
    return RoleParts(factories, context)


def server_kv_layout(c: ServerConfig, model: ModelParts, memory: MemoryParts, speculative: str, kv_heads: int) -> dict:
    """This server's KV layout (common.wire.kv_layout), what a PD peer must match."""
    experts = model_class(model.hf_config).experts_of(model.hf_config)
    moe = experts_layout(experts[0] if experts else 0, c.ep_size, c.ep_num_redundant_experts)
    checksum, dp_size = c.disaggregation_enable_kv_checksum, len(memory.managers)
    weights = describe_weights(detect_scheme(model.model_dir, model.hf_config, c.quantization))
    return kv_layout(
        memory.kv_pool,
        c.transfer_backend,
        model.model_id,
        c.tp_size,
        kv_heads,
        checksum,
        speculative,
        dp_size,
        moe,
        weights,
        c.enable_deterministic_inference,
    )
