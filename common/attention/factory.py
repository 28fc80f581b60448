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
    (common/attention/fixed_split.py) on the CPU, FlashInfer's unsplit KV on CUDA (flashinfer_backend.py); the
    torch backend on CUDA is refused (its batched products are not tiled there)."""
    plain = kv_pool.kind == "mha" and not kv_pool.quantized
    name = resolved_backend(name, device, kv_pool.kind, kv_pool.quantized)
    if name == "torch" and deterministic and device == "cuda":
        raise ValueError(deterministic_torch_on_cuda(kv_pool))
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

        return FlashInferAttention(kv_pool, num_q_heads, head_dim, scaling, flashinfer_backend, deterministic)
    raise ValueError(f"unknown attention_backend {name!r}; choose torch or flashinfer")


def deterministic_torch_on_cuda(kv_pool: KVPool) -> str:
    """The one line refusing --enable-deterministic-inference on the torch backend on CUDA (an explicit flag, or
    what auto chose for an FP8, MLA or float32 pool)."""
    pool = f"{kv_pool.kind.upper()} pool of {str(kv_pool.dtype).removeprefix('torch.')}"
    return (
        f"--enable-deterministic-inference on CUDA runs on FlashInfer (MHA pools in bfloat16/float16), not the torch "
        f"backend this {pool} needs: its batched products are not batch-invariant on CUDA; use --device cpu, or drop "
        "--enable-deterministic-inference"
    )
