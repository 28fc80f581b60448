"""Which model class serves a checkpoint's architecture, and the shape of its attention (what the KV
pool and the attention backend are built for)."""

from __future__ import annotations

from transformers import PretrainedConfig

from common.core.attention_spec import AttentionSpec
from common.model.deepseek import DeepseekForCausalLM
from common.model.llama import LlamaForCausalLM
from common.model.mla import mla_scaling
from common.model.moe_families import MixtralForCausalLM, Qwen3MoeForCausalLM
from common.model.rotary import head_dim_of

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
}


def architecture_of(config: PretrainedConfig) -> str:
    return (getattr(config, "architectures", None) or ["?"])[0]


def model_class(config: PretrainedConfig) -> type[LlamaForCausalLM]:
    arch = architecture_of(config)
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[arch]


def attention_spec(config: PretrainedConfig) -> AttentionSpec:
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    if model_class(config) is DeepseekForCausalLM:
        r = config.kv_lora_rank
        return AttentionSpec("mla", layers, heads, 1, r + config.qk_rope_head_dim, r, mla_scaling(config))
    d = head_dim_of(config)
    return AttentionSpec("mha", layers, heads, config.num_key_value_heads, d, d, d**-0.5)
