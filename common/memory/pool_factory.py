"""Which KV pool a model gets: MHA (K and V per KV head) or MLA (one latent plane), stored in the
model's dtype (`--kv-cache-dtype auto`) or in float8 (fp8_e4m3 / fp8_e5m2, SGLang's and vLLM's names)
with per-layer scales."""

from __future__ import annotations

import torch

from common.core.attention_spec import AttentionSpec
from common.memory.kv_pool import KVPool, kv_bytes_per_token
from common.memory.mla_pool import MLAPool

KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_store_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]


def pool_bytes_per_token(spec: AttentionSpec, store_dtype: torch.dtype) -> int:
    planes = 1 if spec.kind == "mla" else 2
    return kv_bytes_per_token(spec.num_layers, spec.kv_heads, spec.head_dim, store_dtype, planes)


def make_kv_pool(
    spec: AttentionSpec,
    num_pages: int,
    page_size: int,
    store_dtype: torch.dtype,
    model_dtype: torch.dtype,
    device: str,
    scales: list[tuple[float, float]] | None = None,
) -> KVPool:
    if spec.kind == "mla":
        rope_dim, latent = spec.head_dim - spec.v_head_dim, spec.v_head_dim
        return MLAPool(
            spec.num_layers, num_pages, page_size, latent, rope_dim, store_dtype, device, model_dtype, scales
        )
    return KVPool(
        spec.num_layers, num_pages, page_size, spec.kv_heads, spec.head_dim, store_dtype, device, model_dtype, scales
    )


def describe_kv_cache(spec: AttentionSpec, store_dtype: torch.dtype, scales_source: str) -> str:
    """The start-up line: pool kind, stored dtype, and for FP8 where the scales came from."""
    what = f"KV cache: {spec.kind.upper()}, {str(store_dtype).removeprefix('torch.')}"
    return what + (f", per-tensor scales {scales_source}" if store_dtype.itemsize == 1 else "")
