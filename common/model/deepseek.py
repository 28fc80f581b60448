"""DeepSeek-V2 / V3 (`model_type` deepseek_v2, deepseek_v3): MLA attention (common.model.mla) and
mixture-of-experts layers with shared experts after the first `first_k_dense_replace` dense ones.

RoPE is the model's own (YaRN with mscale as DeepSeek configures it, through transformers' initialiser)
over qk_rope_head_dim, which transformers' config names head_dim. Parameter names match the Hugging Face
checkpoints; a V3 checkpoint's multi-token-prediction layer (model.layers.{num_hidden_layers}) is skipped
by the loader.

With several TP ranks each rank holds its query heads and the whole latent (common.model.mla) and every
expert's slice (common.model.moe).
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from common.model.llama import DecoderLayer, LlamaForCausalLM
from common.model.mla import MLAttention
from common.model.moe import RouterGate, SparseMoE
from common.model.routing import deepseek_router, deepseek_topk_method
from common.parallel.group import TensorParallel


def is_moe_layer(config: PretrainedConfig, layer_id: int) -> bool:
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    return layer_id >= first_dense and layer_id % (getattr(config, "moe_layer_freq", 1) or 1) == 0


def deepseek_moe(config: PretrainedConfig, tp: TensorParallel) -> SparseMoE:
    experts, hidden, intermediate = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    gate = RouterGate(hidden, experts, correction_bias=deepseek_topk_method(config) == "noaux_tc")
    moe = SparseMoE(hidden, intermediate, experts, gate, deepseek_router(config), tp)
    if config.n_shared_experts:
        moe.shared_experts = moe.expert(hidden, intermediate * config.n_shared_experts)
    return moe


class DeepseekDecoderLayer(DecoderLayer):
    def make_attention(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        return MLAttention(config, layer_id, self.tp)

    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        return deepseek_moe(config, self.tp) if is_moe_layer(config, layer_id) else super().make_mlp(config, layer_id)


class DeepseekForCausalLM(LlamaForCausalLM):
    layer_class = DeepseekDecoderLayer
    cuda_graph_capturable = False  # MoE layers (and an MLA pool: the torch backend)

    @staticmethod
    def tp_divided(config: PretrainedConfig) -> dict[str, int]:
        return {"intermediate_size": config.intermediate_size, "moe_intermediate_size": config.moe_intermediate_size}
