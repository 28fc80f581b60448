"""The seam between the model and the paged KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from common.core.forward_batch import ForwardBatch
from common.memory.kv_pool import KVPool
from common.wire.user_error import UserError


class AttentionBackend(ABC):
    """Writes the new tokens' K/V into the pool and attends over each request's pages."""

    def __init__(self, kv_pool: KVPool, num_q_heads: int, head_dim: int, scaling: float):
        self.kv_pool = kv_pool
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.scaling = scaling

    @abstractmethod
    def init_forward(self, batch: ForwardBatch) -> None:
        """Prepare per-batch metadata once, before the first layer runs."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] of the new tokens. Returns [T, Hq, D]."""


FLASHINFER_DTYPES = ("bfloat16", "float16")


class AttentionChoiceError(UserError):
    """The flags ask for an attention backend that cannot run here; the message names them."""


def choose_attention_backend(name: str, device: str, dtype: str) -> tuple[str, str | None]:
    """The backend for `--attention-backend name` on `device` with weights of `dtype`, and a warning when
    "auto" cannot take the fast one; a combination that cannot run is refused at start-up, naming the
    flags, instead of failing every forward (FlashInfer has no float32 kernels)."""
    if name == "auto" and device == "cuda" and dtype not in FLASHINFER_DTYPES:
        return "torch", (
            f"--dtype {dtype} on --device cuda: FlashInfer has no {dtype} kernels, using the torch attention "
            "backend (slower); use --dtype bfloat16 for FlashInfer"
        )
    if name == "auto":
        return ("flashinfer" if device == "cuda" else "torch"), None
    if name == "flashinfer" and device != "cuda":
        raise AttentionChoiceError(
            "--attention-backend flashinfer needs --device cuda; use --attention-backend torch on cpu"
        )
    if name == "flashinfer" and dtype not in FLASHINFER_DTYPES:
        raise AttentionChoiceError(
            f"--attention-backend flashinfer has no {dtype} kernels: use --dtype bfloat16 (or float16), "
            "or --attention-backend torch"
        )
    return name, None


def make_attention_backend(
    name: str,
    device: str,
    kv_pool: KVPool,
    num_q_heads: int,
    head_dim: int,
    scaling: float,
    flashinfer_backend: str = "fa2",
) -> AttentionBackend:
    plain = kv_pool.kind == "mha" and not kv_pool.quantized
    if name == "auto":
        name = "flashinfer" if device == "cuda" and plain else "torch"
    if name == "torch":
        from common.attention.torch_backend import TorchAttention

        return TorchAttention(kv_pool, num_q_heads, head_dim, scaling)
    if name == "flashinfer":
        if device != "cuda":
            raise ValueError("attention_backend 'flashinfer' needs --device cuda")
        if not plain:
            raise ValueError(
                "attention_backend 'flashinfer' reads MHA pools in the model's dtype only; this one is "
                f"{kv_pool.kind.upper()} of {str(kv_pool.dtype).removeprefix('torch.')}: use --attention-backend torch"
            )
        from common.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(kv_pool, num_q_heads, head_dim, scaling, flashinfer_backend)
    raise ValueError(f"unknown attention_backend {name!r}; choose torch or flashinfer")
