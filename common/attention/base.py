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

    def prepare_graphs(self, max_bs: int, index_slots: int, tokens: int = 1) -> None:
        """Allocate what graphs of up to `max_bs` rows reading up to `index_slots` pages need, for steps of
        `tokens` new tokens per request (1: decode; k + 1: a speculative verify)."""

    def init_graph_forward(self, batch: ForwardBatch, size: int) -> None:
        """Like init_forward, for a step replayed from the graph of `size` rows: `batch` is the
        padded static batch (common.engine.cuda_graph), and what forward() reads must stay at the same
        addresses from step to step. Graphs run on FlashInfer; this default serves CPU tests, replayed
        eagerly."""
        self.init_forward(batch)


FLASHINFER_DTYPES = ("bfloat16", "float16")
# head dims FlashInfer's prebuilt paths cover (SGLang's checks): others compile, then fail in plan() with
# "Invalid configuration" (below 64 always)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


class AttentionChoiceError(UserError):
    """The flags ask for an attention backend that cannot run here; the message names them."""


def choose_attention_backend(name: str, device: str, dtype: str, head_dim: int | None = None) -> tuple[str, str | None]:
    """The backend for `--attention-backend name` on `device` with weights of `dtype` and MHA heads of
    `head_dim` (None: MLA, which FlashInfer's MHA kernels do not serve anyway), and a warning when "auto"
    cannot take the fast one; a combination that cannot run is refused at start-up, naming the flags,
    instead of failing every forward (FlashInfer has no float32 kernels, nor kernels for every head_dim)."""
    fast_head = head_dim is None or head_dim in FLASHINFER_HEAD_DIMS
    if name == "auto" and device == "cuda" and dtype not in FLASHINFER_DTYPES:
        return "torch", (
            f"--dtype {dtype} on --device cuda: FlashInfer has no {dtype} kernels, using the torch attention "
            "backend (slower); use --dtype bfloat16 for FlashInfer"
        )
    if name == "auto" and device == "cuda" and not fast_head:
        return "torch", (
            f"head_dim {head_dim}: FlashInfer serves head_dim {', '.join(map(str, FLASHINFER_HEAD_DIMS))}, "
            "using the torch attention backend (slower)"
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
    if name == "flashinfer" and not fast_head:
        raise AttentionChoiceError(
            f"--attention-backend flashinfer: this model's head_dim is {head_dim}, FlashInfer serves "
            f"{', '.join(map(str, FLASHINFER_HEAD_DIMS))}; use --attention-backend torch (or auto)"
        )
    return name, None


def resolved_backend(name: str, device: str, kind: str, quantized: bool) -> str:
    """What `--attention-backend name` builds for a pool of `kind` (mha / mla), FP8 or not: "auto" is
    FlashInfer for a plain MHA pool on CUDA, torch otherwise."""
    if name != "auto":
        return name
    return "flashinfer" if device == "cuda" and kind == "mha" and not quantized else "torch"


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
    name = resolved_backend(name, device, kv_pool.kind, kv_pool.quantized)
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
