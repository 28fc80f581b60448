"""What every rank builds alike: its shard of the model, its KV pool (its KV heads; the same pages on
every rank) and its attention backend, and the report of what it holds."""

from __future__ import annotations

import dataclasses
import os
import resource
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from common.attention.base import AttentionBackend, make_attention_backend
from common.config import ServerConfig
from common.memory.kv_pool import KVPool, kv_bytes_per_token
from common.memory.sizing import PoolPlan, plan_kv_pool
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.model.rotary import head_dim_of
from common.parallel.group import TensorParallel
from common.parallel.partition import HeadPartition, head_partition


@dataclass
class RankModel:
    model: LlamaForCausalLM
    heads: HeadPartition
    pool_plan: PoolPlan
    kv_pool: KVPool
    attn: AttentionBackend


def build_rank_model(
    config: ServerConfig,
    model_dir: Path,
    hf: PretrainedConfig,
    dtype: torch.dtype,
    tp: TensorParallel,
    kv_file: str | None = None,
) -> RankModel:
    """Weights first (the pool gets what is left), then a pool of as many pages as the fullest rank holds
    (in `kv_file`, shared, when given: common.parallel.rank_pools)."""
    model = load_model(model_dir, hf, dtype, config.device, tp)
    heads = head_partition(hf.num_attention_heads, hf.num_key_value_heads, tp)
    head_dim = head_dim_of(hf)
    per_token = kv_bytes_per_token(hf.num_hidden_layers, heads.num_kv_heads, head_dim, dtype)
    memory = torch.cuda.mem_get_info() if config.device == "cuda" else None  # (free, total) after the weights
    plan = plan_kv_pool(config.page_size, per_token, config.max_total_tokens, memory, config.mem_fraction_static)
    plan = dataclasses.replace(plan, num_pages=tp.min_int(plan.num_pages))
    pool = KVPool(
        hf.num_hidden_layers,
        plan.num_pages,
        config.page_size,
        heads.num_kv_heads,
        head_dim,
        dtype,
        config.device,
        kv_file,
    )
    attn = make_attention_backend(
        config.attention_backend, config.device, pool, heads.num_heads, head_dim, head_dim**-0.5
    )
    return RankModel(model, heads, plan, pool, attn)


def rank_report(rank: int, built: RankModel) -> dict:
    """What /get_server_info and the start-up summary show of one rank."""
    weights = {id(p): p.numel() * p.element_size() for p in built.model.parameters()}
    return {
        "rank": rank,
        "pid": os.getpid(),
        "q_heads": built.heads.num_heads,
        "kv_heads": built.heads.num_kv_heads,
        "first_kv_head": built.heads.kv_head_start,
        "weight_bytes": sum(weights.values()),
        "kv_pool_bytes": built.kv_pool.total_bytes,
        "kv_pages": built.pool_plan.num_pages,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def describe_rank(r: dict) -> str:
    return (
        f"tp rank {r['rank']} (pid {r['pid']}): {r['q_heads']} query heads, {r['kv_heads']} KV heads from "
        f"{r['first_kv_head']}, weights {r['weight_bytes'] / 2**20:.1f} MiB, KV pool {r['kv_pages']} pages "
        f"{r['kv_pool_bytes'] / 2**20:.1f} MiB, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB"
    )
