"""Which attention backend a rank builds: the torch backend (any device, any pool; with a fixed KV split under
--enable-deterministic-inference), or FlashInfer (CUDA, MHA pools in the model's dtype); common/attention/choice.py
has the rules, checked before the weights load."""

from __future__ import annotations

from common.attention.base import AttentionBackend
from common.attention.choice import check_attention_device, resolved_backend
from common.memory.kv_pool import KVPool


def make_attention_backend(
    name: str,
    device: str,
    kv_pool: KVPool,
    num_q_heads: int,
    head_dim: int,
    scaling: float,
    flashinfer_backend: str = "fa2",
    deterministic: bool = False,
) -> AttentionBackend:
    """`deterministic` (--enable-deterministic-inference): the torch backend's fixed KV split
    (common/attention/fixed_split.py); the flag refuses FlashInfer at start-up (common/config_checks.py)."""
    plain = kv_pool.kind == "mha" and not kv_pool.quantized
    name = resolved_backend(name, device, kv_pool.kind, kv_pool.quantized)
    if name == "torch" and deterministic:
        from common.attention.fixed_split import FixedSplitAttention

        return FixedSplitAttention(kv_pool, num_q_heads, head_dim, scaling)
    if name == "torch":
        from common.attention.torch_backend import TorchAttention

        return TorchAttention(kv_pool, num_q_heads, head_dim, scaling)
    if name == "flashinfer":
        check_attention_device(name, device)
        if not plain:
            raise ValueError(
                "attention_backend 'flashinfer' reads MHA pools in the model's dtype only; this one is "
                f"{kv_pool.kind.upper()} of {str(kv_pool.dtype).removeprefix('torch.')}: use --attention-backend torch"
            )
        from common.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(kv_pool, num_q_heads, head_dim, scaling, flashinfer_backend)
    raise ValueError(f"unknown attention_backend {name!r}; choose torch or flashinfer")
