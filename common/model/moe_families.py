"""Qwen3-MoE and Mixtral: the Llama decoder (Qwen3-MoE with Qwen3's q/k norm) whose MLPs are
mixture-of-experts layers with top-k softmax routing (common.model.routing.softmax_topk).

Qwen3-MoE keeps dense MLPs in `mlp_only_layers` and off the `decoder_sparse_step` grid and renormalises
the top-k weights when `norm_topk_prob`; Mixtral always renormalises, and its checkpoints name the MoE
layer `block_sparse_moe` and an expert's projections w1 (gate), w3 (up), w2 (down).
"""

from __future__ import annotations

import re

from torch import nn
from transformers import PretrainedConfig

from common.model.llama import DecoderLayer, LlamaForCausalLM
from common.model.moe import RouterGate, SparseMoE
from common.model.routing import softmax_router

MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def softmax_moe(config: PretrainedConfig, num_experts: int, intermediate: int, renormalize: bool, tp) -> SparseMoE:
    gate = RouterGate(config.hidden_size, num_experts)
    return SparseMoE(config.hidden_size, intermediate, num_experts, gate, softmax_router(config, renormalize), tp)


class Qwen3MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        sparse = (
            layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0
            and (layer_id + 1) % config.decoder_sparse_step == 0
        )
        if not sparse:
            return super().make_mlp(config, layer_id)
        renormalize = bool(config.norm_topk_prob)
        return softmax_moe(config, config.num_experts, config.moe_intermediate_size, renormalize, self.tp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
    cuda_graph_capturable = False  # the experts a step runs are read back (common.model.moe)

    @staticmethod
    def tp_divided(config: PretrainedConfig) -> dict[str, int]:
        return {"intermediate_size": config.intermediate_size, "moe_intermediate_size": config.moe_intermediate_size}


class MixtralDecoderLayer(DecoderLayer):
    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        return softmax_moe(config, config.num_local_experts, config.intermediate_size, True, self.tp)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_class = MixtralDecoderLayer
    cuda_graph_capturable = False

    @staticmethod
    def checkpoint_name(name: str) -> str:
        name = name.replace(".mlp.", ".block_sparse_moe.")
        return re.sub(
            r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)\.", lambda m: m[1] + MIXTRAL_NAMES[m[2]] + ".", name
        )
