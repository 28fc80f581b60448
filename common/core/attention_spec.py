"""A model's attention shape: what its KV pool and attention backend are built for
(common.model.registry.attention_spec makes it from a config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class AttentionSpec:
    """mha: K and V per KV head. mla: one KV "head" per token, the latent (v_head_dim = kv_lora_rank wide)
    followed by the rope key; attention reads V as the latent, the first v_head_dim of K."""

    kind: Literal["mha", "mla"]
    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int  # of Q and K as attention sees them
    v_head_dim: int
    scaling: float
