"""Tiny random models of the MoE and MLA families (Mixtral, Qwen3-MoE, DeepSeek-V2, DeepSeek-V3),
saved by transformers with its own config classes, for the tests that check them against transformers
and across PD."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.integration.test_architectures import COMMON, save_tiny

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32)
FAMILIES = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # a dense layer in the middle (mlp_only_layers), renormalised top-k
    "qwen3_moe": (
        "qwen3_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True)
        | dict(mlp_only_layers=[1], num_hidden_layers=3),
    ),
    # no q LoRA, group-limited greedy routing, YaRN with mscale != mscale_all_dim
    "deepseek_v2": (
        "deepseek_v2",
        MLA
        | dict(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
        | dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5)
        | dict(rope_scaling=YARN | {"mscale": 0.707, "mscale_all_dim": 0.5}),
    ),
    # q LoRA, sigmoid scores with a (random) correction bias over groups, scaled; YaRN mscale_all_dim
    "deepseek_v3": (
        "deepseek_v3",
        MLA
        | dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1)
        | dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, num_hidden_layers=3)
        | dict(rope_scaling=YARN | {"mscale": 1.0, "mscale_all_dim": 1.0}),
    ),
}


def save_family(path: Path, family: str) -> Path:
    model_type, extra = FAMILIES[family]
    save_tiny(path, model_type, extra)
    if family == "deepseek_v3":  # transformers initialises the correction bias to zeros: give it weight
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        g = torch.Generator().manual_seed(2)
        for layer in model.model.layers[1:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.rand(bias.shape, generator=g) * 0.5)
        model.save_pretrained(path)
    return path


def config_of(family: str):
    model_type, extra = FAMILIES[family]
    return AutoConfig.for_model(model_type, **(COMMON | extra))
