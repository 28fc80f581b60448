"""DeepSeek's multi-head latent attention (MLA) over a latent KV pool, with the absorbed weights.

Per token the pool keeps one "head": the normalised latent c (kv_lora_rank) followed by the rotated
rope key k_pe (qk_rope_head_dim), shared by every query head. kv_b_proj maps c to each head's no-rope
key and value: k_nope = W_UK c, v = W_UV c. Absorbing W_UK into the query,

    q . k = q_nope . (W_UK c) + q_pe . k_pe = (W_UK^T q_nope) . c + q_pe . k_pe

attention becomes multi-query attention of [W_UK^T q_nope, q_pe] against the pool's [c, k_pe] with the
latent c itself as the value; W_UV then maps each head's attended latent to its value space. Nothing
is decompressed per cached token: 31-37x faster decode on the CPU than decompressing the latent on the
fly, though decompressing would be 1.3-2x faster for prefill (benchmarks/mla_attention.py,
docs/performance.md).

With several TP ranks each rank keeps its query heads (q_proj / q_b_proj rows, kv_b_proj rows, o_proj
columns, all-reduced) and the whole latent: q_a_proj and kv_a_proj_with_mqa are replicated, so every
rank computes and caches the same latent and its pool is the whole MLA pool (nothing to slice in PD).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch
from common.model.llama import RMSNorm
from common.model.rotary import apply_rotary, rope_parameters
from common.parallel.group import SINGLE, TensorParallel
from common.parallel.invariant import rows
from common.parallel.layers import ColumnParallelLinear, RowParallelLinear


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_scaling(config: PretrainedConfig) -> float:
    """qk_head_dim ** -0.5, times mscale_all_dim's YaRN factor squared when the RoPE is scaled (DeepSeek's rule)."""
    scaling = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        scaling *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scaling


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: pairs (x0, x1), (x2, x3)... each rotated by one frequency; the result lists the
    pairs' first then second elements (as transformers' V3 does; q and k alike, so q . k is unchanged)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads // tp.size  # this rank's
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        hidden, qk_dim, bias = config.hidden_size, self.nope + self.rope, bool(getattr(config, "attention_bias", False))
        heads = config.num_attention_heads
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, False, tp)
        else:
            self.q_a_proj = ColumnParallelLinear(hidden, self.q_lora_rank, bias)  # whole on every rank
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_dim, False, tp)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, self.kv_lora_rank + self.rope, bias)  # whole
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope + self.v_head_dim), False, tp)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias, tp)
        self.interleaved = bool(getattr(config, "rope_interleave", True))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, cos_sin: tuple, attn: AttentionBackend, batch: ForwardBatch) -> torch.Tensor:
        t, r = x.shape[0], self.kv_lora_rank
        q_nope, q_pe = self._query(x).view(t, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([r, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        rotate = apply_rotary_interleaved if self.interleaved else apply_rotary
        q_pe, k_pe = rotate(q_pe, *cos_sin), rotate(k_pe[:, None, :], *cos_sin)
        w = self.kv_b_proj.dense_weight(x.dtype).view(self.num_heads, self.nope + self.v_head_dim, r)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_latent = rows(lambda q: torch.einsum("thn,hnr->thr", q, w_uk), q_nope)
        kv = torch.cat((latent[:, None, :], k_pe), dim=-1)  # [T, 1, r + rope]: what the pool keeps
        out = attn.forward(torch.cat((q_latent, q_pe), dim=-1), kv, kv[..., :r], self.layer_id, batch)
        out = rows(lambda o: torch.einsum("thr,hvr->thv", o, w_uv), out)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_head_dim))
