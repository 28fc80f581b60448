"""Llama-architecture decoder (Llama 2/3, Mistral, Qwen2/2.5/3, SmolLM2) over a paged KV cache; the base
of the MoE families (common.model.moe_families) and DeepSeek (common.model.deepseek).

Parameter names match Hugging Face's, so a safetensors checkpoint loads with `load_state_dict`. With a
TensorParallel group of several ranks each rank holds its heads, its share of the MLP and of the
vocabulary (common.parallel.layers); the loader reads only that share. The MoE and DeepSeek families
shard the same way (common.model.moe, common.model.mla).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch
from common.model.rotary import RotaryEmbedding, apply_rotary, head_dim_of
from common.parallel import invariant
from common.parallel.group import SINGLE, TensorParallel
from common.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    fuse_columns,
    linear,
)
from common.parallel.partition import head_partition

if TYPE_CHECKING:
    from common.lora.batch import LayerLora

QK_NORM_ARCHITECTURES = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(invariant.rowwise(lambda t: t.pow(2).mean(-1, keepdim=True), x) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        heads = head_partition(config.num_attention_heads, config.num_key_value_heads, tp)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = d = head_dim_of(config)
        arch = (config.architectures or ["LlamaForCausalLM"])[0]
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        o_bias = arch != "Qwen2ForCausalLM" and bool(getattr(config, "attention_bias", False))
        hidden, q_rows = config.hidden_size, config.num_attention_heads * d
        kv_rows, kv_start = config.num_key_value_heads * d, heads.kv_head_start * d
        kv_slice = (kv_start, kv_start + self.num_kv_heads * d)
        self.q_proj = ColumnParallelLinear(hidden, q_rows, qkv_bias, tp)
        self.k_proj = ColumnParallelLinear(hidden, kv_rows, qkv_bias, tp, kv_slice)
        self.v_proj = ColumnParallelLinear(hidden, kv_rows, qkv_bias, tp, kv_slice)
        self.o_proj = RowParallelLinear(q_rows, hidden, o_bias, tp)
        self.qk_norm = arch in QK_NORM_ARCHITECTURES
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse(): one weight for q, k, v

    def fuse(self, filled: bool = True) -> None:
        """q_proj, k_proj and v_proj become rows of one weight: one matmul instead of three (`filled`:
        fuse_columns)."""
        self.qkv = fuse_columns([self.q_proj, self.k_proj, self.v_proj], filled)
        self.qkv_sizes = [p.weight.shape[0] for p in (self.q_proj, self.k_proj, self.v_proj)]

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple,
        attn: AttentionBackend,
        batch: ForwardBatch,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        """`lora`: the batch's adapters at this layer (--enable-lora), added to each part of the fused qkv."""
        t = x.shape[0]
        if self.qkv is not None:
            q, k, v = linear(x, *self.qkv).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if lora is not None:
            q, k, v = lora.add(q, x, "q_proj"), lora.add(k, x, "k_proj"), lora.add(v, x, "v_proj")
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = attn.forward(q, k, v, self.layer_id, batch).reshape(t, self.num_heads * self.head_dim)
        return self.o_proj(out) if lora is None else lora.row_parallel(self.o_proj, out, "o_proj")


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)): a dense layer, one expert of an MoE layer, or its shared experts. With
    several ranks each holds its slice of the intermediate features; `reduce=False` leaves the partial
    sum of down to the caller (an MoE layer reduces once)."""

    def __init__(self, hidden: int, intermediate: int, bias=False, tp: TensorParallel = SINGLE, reduce=True):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, bias, tp)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp, reduce)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse(): one weight for both

    def fuse(self, filled: bool = True) -> None:
        """gate_proj and up_proj become rows of one weight: one matmul instead of two (`filled`: fuse_columns)."""
        self.gate_up = fuse_columns([self.gate_proj, self.up_proj], filled)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        """`lora`: the batch's adapters at this layer (--enable-lora), added to each part of the fused gate_up."""
        if self.gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = linear(x, *self.gate_up).chunk(2, dim=-1)
        if lora is None:
            return self.down_proj(F.silu(gate) * up)
        h = F.silu(lora.add(gate, x, "gate_proj")) * lora.add(up, x, "up_proj")
        return lora.row_parallel(self.down_proj, h, "down_proj")


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp, self.layer_id = tp, layer_id
        self.self_attn = self.make_attention(config, layer_id)
        self.mlp = self.make_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_attention(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        return Attention(config, layer_id, self.tp.attn)

    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        """A dense MLP: split like the attention (whole on each rank under DP attention)."""
        bias = bool(getattr(config, "mlp_bias", False))
        return MLP(config.hidden_size, config.intermediate_size, bias, self.tp.attn)

    def forward(self, x: torch.Tensor, cos_sin: tuple, attn: AttentionBackend, batch: ForwardBatch) -> torch.Tensor:
        if batch.lora is not None:  # a dense Llama-family layer (LoRA refuses the others at start-up)
            return self._forward_lora(x, cos_sin, attn, batch, batch.lora.layer(self.layer_id))
        if len(x):  # an idle batch (DP attention: no tokens on this rank) still joins the MoE layers
            x = x + self.self_attn(self.input_layernorm(x), cos_sin, attn, batch)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, batch) if getattr(self.mlp, "takes_batch", False) else self.mlp(h))

    def _forward_lora(
        self, x: torch.Tensor, cos_sin: tuple, attn: AttentionBackend, batch: ForwardBatch, lora: LayerLora
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, attn, batch, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaModel(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_class: type[DecoderLayer] = DecoderLayer, tp: TensorParallel = SINGLE
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp.attn)
        self.layers = nn.ModuleList(layer_class(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        return self.forward_capturing(batch, attn, ())[0]

    def forward_capturing(
        self, batch: ForwardBatch, attn: AttentionBackend, capture: tuple[int, ...]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final (normed) hidden states, and the residual stream at the input of each layer in `capture`,
        in layer order (EAGLE3's aux hidden states: SGLang's layers_to_capture)."""
        x = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary_emb(batch, x.dtype)
        captured = []
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured.append(x)
            x = layer(x, cos_sin, attn, batch)
        return self.norm(x), captured


class LlamaForCausalLM(nn.Module):
    """Subclasses (the MoE and DeepSeek families) change the decoder layer; the rest is shared."""

    layer_class: type[DecoderLayer] = DecoderLayer
    cuda_graph_capturable = True  # its decode forward decides nothing on the host (common.engine.cuda_graph)

    @staticmethod
    def tp_divided(config: PretrainedConfig) -> dict[str, int]:
        """The config's sizes of the dense layers (besides the heads) that the attention's ranks must divide."""
        return {"intermediate_size": config.intermediate_size}

    @staticmethod
    def experts_of(config: PretrainedConfig) -> tuple[int, dict[str, int]] | None:
        """An MoE family's routed experts and the experts' sizes that TP-MoE's ranks must divide; None: dense."""
        return None

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config, self.tp = config, tp
        self.model = LlamaModel(config, self.layer_class, tp)
        tied = self.model.embed_tokens if getattr(config, "tie_word_embeddings", False) else None
        # the vocabulary spans every rank, but a tied head is split like the embedding (whole under DP attention)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp if tied is None else tp.attn, tied)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The checkpoint's name of the parameter `name` (the same unless a family names it otherwise)."""
        return name

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Returns float32 logits for the rows `batch.logits_indices` of the new tokens; under DP attention
        those of every rank's rows, in rank order (the LM head's vocabulary spans the ranks)."""
        hidden = self.model(batch, attn)[batch.logits_indices]
        if batch.dp is not None:
            hidden = self.tp.all_gather_rows(hidden, batch.dp.rows)
        return self.lm_head(hidden).float()
