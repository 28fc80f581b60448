"""The seam between the model and the paged KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from common.core.forward_batch import ForwardBatch
from common.memory.kv_pool import KVPool


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
