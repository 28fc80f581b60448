"""What every rank builds alike: its shard of the model, its KV pool (its KV heads; the same pages on
every rank) and its attention backend, and the report of what it holds."""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from common.attention.base import AttentionBackend
from common.attention.choice import resolved_backend
from common.attention.factory import make_attention_backend
from common.config import ServerConfig
from common.memory.kv_pool import KVPool
from common.memory.pool_factory import describe_kv_cache, kv_store_dtype, make_kv_pool, pool_bytes_per_token
from common.memory.sizing import PoolPlan, plan_kv_pool
from common.memory.static_reserve import (
    GPU_MAX_RUNNING,
    StaticReserve,
    attention_bytes,
    graph_bytes,
    graph_plan,
    req_to_token_bytes,
)
from common.model.draft import DraftWeights, draft_config, load_draft, with_draft_layers
from common.model.draft_head import DraftHead
from common.model.eagle import eagle_config, load_eagle_head
from common.model.eagle3 import eagle3_config, load_eagle3_head
from common.model.kv_scales import read_kv_scales
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.model.moe import expert_placement, moe_layers
from common.model.nextn import check_nextn, load_mtp
from common.model.registry import attention_spec, model_class
from common.parallel import invariant
from common.parallel.group import TensorParallel
from common.parallel.partition import HeadPartition, head_partition
from common.quant.fp8_block import reserve_buffers

log = logging.getLogger(__name__)


@dataclass
class RankModel:
    model: LlamaForCausalLM
    heads: HeadPartition
    pool_plan: PoolPlan
    kv_pool: KVPool
    attn: AttentionBackend
    reserved: StaticReserve  # what the pool's sizing set aside for the buffers allocated after it
    draft: DraftWeights | None = None  # STANDALONE's draft model (TP 1), its KV the pool's last layers
    draft_head: DraftHead | None = None  # NEXTN's MTP layer, an EAGLE or EAGLE3 head (TP 1): the pool's last layer


def build_rank_model(
    config: ServerConfig, model_dir: Path, hf: PretrainedConfig, dtype: torch.dtype, tp: TensorParallel
) -> RankModel:
    """Weights first (the pool gets what is left), then a pool of as many pages as the fullest rank holds."""
    tp = model_layout(tp, config)
    invariant.enable(config.enable_deterministic_inference)  # the products every layer calls (before any runs)
    algo, path = config.speculative_algorithm, config.speculative_draft_model_path
    found = draft_config(path, hf) if algo == "STANDALONE" else None  # refused before anything loads
    eagle = eagle_config(path, hf) if algo == "EAGLE" else eagle3_config(path, hf) if algo == "EAGLE3" else None
    if algo == "NEXTN":
        check_nextn(hf, model_dir)
    model = load_model(model_dir, hf, dtype, config.device, tp, config.quantization)
    for moe in moe_layers(model):
        moe.count_loads = config.enable_eplb  # EPLB's measurement (common.model.eplb)
    draft = load_draft(found, dtype, config.device, hf.num_hidden_layers) if found else None
    head = None
    if algo == "NEXTN":
        head = load_mtp(model_dir, hf, model, dtype, config.device)
    elif eagle is not None:
        load_head = load_eagle_head if algo == "EAGLE" else load_eagle3_head
        head = load_head(eagle, model, dtype, config.device)
    whole = with_draft_layers(attention_spec(hf), draft)
    if head is not None:
        whole = dataclasses.replace(whole, num_layers=whole.num_layers + 1)
    heads = head_partition(whole.q_heads, whole.kv_heads, tp.attn)
    spec = dataclasses.replace(whole, q_heads=heads.num_heads, kv_heads=heads.num_kv_heads)  # this rank's
    store_dtype = kv_store_dtype(config.kv_cache_dtype, dtype)
    if config.device == "cuda" and (buffers := reserve_buffers(model, dtype)):
        log.info("FP8 dequantization buffers: %.1f MiB, set aside before the KV pool", buffers / 2**20)
    memory = torch.cuda.mem_get_info() if config.device == "cuda" else None  # (free, total) after the weights
    per_token = pool_bytes_per_token(spec, store_dtype)
    reserved = static_reserve(config, hf, spec.kind, store_dtype.itemsize == 1) if memory else StaticReserve()
    plan = plan_kv_pool(
        config.page_size, per_token, config.max_total_tokens, memory, config.mem_fraction_static, reserved
    )
    plan = dataclasses.replace(plan, num_pages=tp.min_int(plan.num_pages))
    scales, source = read_kv_scales(model_dir, hf.num_hidden_layers)
    scales += [(1.0, 1.0)] * (spec.num_layers - len(scales))  # a draft's layers: unscaled
    log.info("%s", describe_kv_cache(spec, store_dtype, source))
    pool = make_kv_pool(spec, plan.num_pages, config.page_size, store_dtype, dtype, config.device, scales)
    backend = (config.attention_backend, config.device, pool)
    chosen = (config.flashinfer_backend, config.enable_deterministic_inference)
    attn = make_attention_backend(*backend, spec.q_heads, spec.head_dim, spec.scaling, *chosen)
    if draft is not None:  # its own backend over the same pool only when its query heads differ
        draft.shares_attn = draft.heads() == (spec.q_heads, spec.head_dim, spec.scaling)
        own = None if draft.shares_attn else make_attention_backend(*backend, *draft.heads(), *chosen)
        draft.attn = own or attn
    return RankModel(model, heads, plan, pool, attn, reserved, draft, head)


def static_reserve(config: ServerConfig, hf: PretrainedConfig, kind: str, quantized: bool) -> StaticReserve:
    """The buffers allocated after the pool (static_reserve.py), at the most the flags allow: every rank
    counts rank 0's req_to_token, so the pages (the ranks' minimum) leave room for it."""
    rows = config.max_running_requests if "max_running_requests" in config.model_fields_set else GPU_MAX_RUNNING
    context = config.context_length or getattr(hf, "max_position_embeddings", 4096)
    backend = resolved_backend(config.attention_backend, config.device, kind, quantized)
    at_most = config.model_copy(update={"max_running_requests": rows})
    sizes, _ = graph_plan(at_most, backend, model_class(hf).cuda_graph_capturable)
    graphs = 0
    if sizes:
        slots = sizes[-1] * -(-context // config.page_size)
        itemsize = getattr(torch, config.torch_dtype_name).itemsize
        k = config.speculative_draft_len  # verify graphs' logits: k + 1 rows per request
        logits_rows = sizes[-1] * (1 + (k + 1 if k else 0))
        graphs = graph_bytes(logits_rows, hf.hidden_size, hf.intermediate_size, hf.vocab_size, itemsize, slots)
    return StaticReserve(
        req_to_token=req_to_token_bytes(rows, context, config.page_size),
        attention=attention_bytes(backend, len(sizes) * (2 if config.speculative_draft_len else 1)),  # + verify
        cuda_graphs=graphs,
    )


def model_layout(tp: TensorParallel, config: ServerConfig) -> TensorParallel:
    """The group as the model is laid out over it: whole experts (--ep-size), DP attention."""
    return dataclasses.replace(
        tp,
        ep=config.ep_size > 1,
        dp_attention=config.enable_dp_attention and tp.size > 1,
        redundant_experts=config.ep_num_redundant_experts,
    )


def rank_report(rank: int, built: RankModel) -> dict:
    """What /get_server_info and the start-up summary show of one rank."""
    weights = {id(p): p.numel() * p.element_size() for p in built.model.parameters()}
    placement = expert_placement(built.model)
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "q_heads": built.heads.num_heads,
        "kv_heads": built.heads.num_kv_heads,
        "first_kv_head": built.heads.kv_head_start,
        "weight_bytes": sum(weights.values()),
        "kv_pool_bytes": built.kv_pool.total_bytes,
        "kv_pages": built.pool_plan.num_pages,
        "experts": next(iter(placement.values()))[rank] if placement else None,  # held in the first MoE layer
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def describe_rank(r: dict) -> str:
    experts = f", experts {r['experts']}" if r.get("experts") is not None else ""
    return (
        f"tp rank {r['rank']} (pid {r['pid']} on {r['host']}): {r['q_heads']} query heads, {r['kv_heads']} KV heads from "
        f"{r['first_kv_head']}{experts}, weights {r['weight_bytes'] / 2**20:.1f} MiB, KV pool {r['kv_pages']} pages "
        f"{r['kv_pool_bytes'] / 2**20:.1f} MiB, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB"
    )
