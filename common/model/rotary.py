"""Rotary position embedding for every `rope_type` transformers supports on Llama-family models.

The inverse frequencies are float32 whatever the weights' dtype, and follow the model across devices:
a cast to bf16 would move the angles by radians after a few thousand positions (transformers keeps them
in float32 too). They are computed by transformers' own initialisers, so every scaling type means what it
means there; the two types whose frequencies depend on the sequence length ("dynamic", "longrope") use,
per request, the request's whole length (prompt and output so far) as transformers' `generate` does for
one sequence, also when its prompt is prefilled in chunks.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from common.core.forward_batch import ForwardBatch

LENGTH_DEPENDENT = {"dynamic", "longrope"}


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config: PretrainedConfig) -> dict:
    """rope_type, rope_theta and the scaling settings (transformers 5's rope_parameters, 4's rope_scaling)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), **params, "rope_type": rope_type}


def default_inv_freq(config: PretrainedConfig, device: str | torch.device) -> torch.Tensor:
    dim = head_dim_of(config)
    return 1.0 / (
        rope_parameters(config)["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim)
    )


class RotaryEmbedding(nn.Module):
    """cos/sin of every new token's position, in the activations' dtype (as transformers applies them)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config
        params = rope_parameters(config)
        self.rope_type = params["rope_type"]
        with torch.device("cpu"):  # real values even when the model is built on the meta device; _apply moves them
            inv_freq, self.scaling = self._init_inv_freq()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        if self.rope_type == "longrope":
            self.length_limit = params["original_max_position_embeddings"]
            with torch.device("cpu"):
                long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=self.length_limit + 1)
            self.register_buffer("long_inv_freq", long_freq.float(), persistent=False)
        elif self.rope_type == "dynamic":
            self.length_limit = config.max_position_embeddings
            dim = int(head_dim_of(config) * params.get("partial_rotary_factor", 1.0))
            self.ntk = (params["rope_theta"], params["factor"], dim)
            exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
            self.register_buffer("ntk_exponents", exponents, persistent=False)

    def _init_inv_freq(self) -> tuple[torch.Tensor, float]:
        if self.rope_type == "default":
            return default_inv_freq(self.config, "cpu"), 1.0
        if self.rope_type in ROPE_INIT_FUNCTIONS:
            return ROPE_INIT_FUNCTIONS[self.rope_type](self.config, "cpu")
        raise ValueError(
            f"rope_type {self.rope_type!r} is not supported; supported: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}"
        )

    def _apply(self, fn, recurse=True):
        """Device moves apply to the frequencies, dtype casts do not: they stay float32."""
        kept = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, fp32 in kept.items():
            self._buffers[name] = fp32.to(self._buffers[name].device)
        return self

    def forward(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = batch.positions.float()[:, None]
        freqs = positions * self._inv_freq_per_token(batch)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def _inv_freq_per_token(self, batch: ForwardBatch) -> torch.Tensor:
        """[1, D/2], or [T, D/2] for the length-dependent types."""
        if self.rope_type not in LENGTH_DEPENDENT:
            return self.inv_freq[None, :]
        seq_len = batch.rope_lens[:, None]  # per token, built with the batch: no host work per forward
        if self.rope_type == "longrope":
            return torch.where(seq_len > self.length_limit, self.long_inv_freq, self.inv_freq)
        return torch.where(seq_len > self.length_limit, self._dynamic_inv_freq(seq_len), self.inv_freq)

    def _dynamic_inv_freq(self, seq_len: torch.Tensor) -> torch.Tensor:
        """transformers' dynamic NTK frequencies, the same operations in the same dtypes, for per-token
        lengths on the device (its function builds a scalar tensor per call: a host-to-device copy)."""
        base, factor, dim = self.ntk
        longest = seq_len.clamp_min(self.length_limit)
        scaled_base = base * ((factor * longest / self.length_limit) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (scaled_base**self.ntk_exponents)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D] in x's dtype. Rotate-half convention and arithmetic, as transformers."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
