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

from common.attention.base import AttentionBackend, make_attention_backend
from common.config import ServerConfig
from common.memory.kv_pool import KVPool
from common.memory.pool_factory import describe_kv_cache, kv_store_dtype, make_kv_pool, pool_bytes_per_token
from common.memory.sizing import PoolPlan, plan_kv_pool
from common.model.kv_scales import read_kv_scales
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_hf_config, load_model, resolve_model_dir
from common.model.registry import attention_spec
from common.parallel.group import TensorParallel
from common.parallel.partition import HeadPartition, head_partition
from common.wire.user_error import UserError

log = logging.getLogger(__name__)


@dataclass
class RankModel:
    model: LlamaForCausalLM
    heads: HeadPartition
    pool_plan: PoolPlan
    kv_pool: KVPool
    attn: AttentionBackend
    draft: DraftWeights | None = None  # STANDALONE's draft model (TP 1), its KV the pool's last layers


@dataclass
class DraftWeights:
    model: LlamaForCausalLM
    model_dir: Path
    attn: AttentionBackend  # the target's when the heads match, else its own over the same pool
    shares_attn: bool


def build_rank_model(
    config: ServerConfig, model_dir: Path, hf: PretrainedConfig, dtype: torch.dtype, tp: TensorParallel
) -> RankModel:
    """Weights first (the pool gets what is left), then a pool of as many pages as the fullest rank holds."""
    draft_dir, draft_hf = draft_config(config, hf)  # refused before anything loads
    model = load_model(model_dir, hf, dtype, config.device, tp)
    draft = load_model(draft_dir, draft_hf, dtype, config.device) if draft_dir else None
    whole = attention_spec(hf)
    if draft is not None:  # its KV: extra layers of the same pages, after the target's
        offset_layers(draft, whole.num_layers)
        whole = dataclasses.replace(whole, num_layers=whole.num_layers + draft_hf.num_hidden_layers)
    heads = head_partition(whole.q_heads, whole.kv_heads, tp)
    spec = dataclasses.replace(whole, q_heads=heads.num_heads, kv_heads=heads.num_kv_heads)  # this rank's
    store_dtype = kv_store_dtype(config.kv_cache_dtype, dtype)
    memory = torch.cuda.mem_get_info() if config.device == "cuda" else None  # (free, total) after the weights
    per_token = pool_bytes_per_token(spec, store_dtype)
    plan = plan_kv_pool(config.page_size, per_token, config.max_total_tokens, memory, config.mem_fraction_static)
    plan = dataclasses.replace(plan, num_pages=tp.min_int(plan.num_pages))
    scales, source = read_kv_scales(model_dir, hf.num_hidden_layers)
    scales += [(1.0, 1.0)] * (spec.num_layers - len(scales))  # a draft's layers: unscaled
    log.info("%s", describe_kv_cache(spec, store_dtype, source))
    pool = make_kv_pool(spec, plan.num_pages, config.page_size, store_dtype, dtype, config.device, scales)
    attn = make_attention_backend(
        config.attention_backend, config.device, pool, spec.q_heads, spec.head_dim, spec.scaling
    )
    weights = None
    if draft is not None:
        d = attention_spec(draft_hf)
        shape = (d.q_heads, d.head_dim, d.scaling)
        same = shape == (spec.q_heads, spec.head_dim, spec.scaling)
        own = None if same else make_attention_backend(config.attention_backend, config.device, pool, *shape)
        weights = DraftWeights(draft, draft_dir, own or attn, same)
    return RankModel(model, heads, plan, pool, attn, weights)


def draft_config(config: ServerConfig, hf: PretrainedConfig) -> tuple[Path | None, PretrainedConfig | None]:
    """STANDALONE's draft model directory and config, checked against the target's: the same vocabulary and
    the same KV shape per layer (its KV is stored as more layers of the target's pages)."""
    if not config.speculative_draft_model_path:
        return None, None
    draft_dir = resolve_model_dir(config.speculative_draft_model_path)
    draft_hf = load_hf_config(draft_dir)
    target, draft = attention_spec(hf), attention_spec(draft_hf)
    mine = (target.kind, target.kv_heads, target.head_dim, target.v_head_dim, hf.vocab_size)
    theirs = (draft.kind, draft.kv_heads, draft.head_dim, draft.v_head_dim, draft_hf.vocab_size)
    if mine != theirs:
        raise UserError(
            f"--speculative-draft-model-path {config.speculative_draft_model_path}: its (attention, KV heads, head "
            f"dim, V head dim, vocabulary) is {theirs}, the target's {mine}; a STANDALONE draft keeps its KV as more "
            "layers of the target's pages, so they must match: give a draft of the same family (e.g. the target's "
            "first layers: python -m common.model.truncate)"
        )
    return draft_dir, draft_hf


def offset_layers(model: LlamaForCausalLM, offset: int) -> None:
    """Every attention layer of `model` reads and writes the pool's layer `offset` + its own index."""
    for module in model.modules():
        if isinstance(getattr(module, "layer_id", None), int):
            module.layer_id += offset


def rank_report(rank: int, built: RankModel) -> dict:
    """What /get_server_info and the start-up summary show of one rank."""
    weights = {id(p): p.numel() * p.element_size() for p in built.model.parameters()}
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
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def describe_rank(r: dict) -> str:
    return (
        f"tp rank {r['rank']} (pid {r['pid']} on {r['host']}): {r['q_heads']} query heads, {r['kv_heads']} KV heads from "
        f"{r['first_kv_head']}, weights {r['weight_bytes'] / 2**20:.1f} MiB, KV pool {r['kv_pages']} pages "
        f"{r['kv_pool_bytes'] / 2**20:.1f} MiB, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB"
    )
