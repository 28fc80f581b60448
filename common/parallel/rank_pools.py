"""Every rank's KV pool as one transfer layout, for a prefill or decode server with `--tp-size N` (CPU).

Each follower's pool is a shared file (`pool_file`) that rank 0 maps too, so rank 0's one transfer
engine registers N buffers: its own pool and the followers', in rank order. At equal TP sizes the
transfer layer pairs a prefill's buffers with a decode's by index (rank r's KV heads go from prefill
rank r to decode rank r); at unequal ones it slices each decode rank's heads out of the prefill ranks'
pages (common.wire.kv_heads, transfer.prefill.runs.slice_triples).
"""

from __future__ import annotations

import os

from common.memory.kv_pool import BufferInfo, KVPool, map_shared


def pool_file(progress_path: str, rank: int) -> str:
    """Where follower `rank` keeps its pool (beside the progress file, in shared memory)."""
    return f"{progress_path}.kv{rank}"


class RankPools:
    """Rank 0's pool's sizes (each rank's are the same) and `buffer_infos()` of every rank's buffer."""

    def __init__(self, own: KVPool, progress_path: str, tp_size: int):
        self.own, self.tp_size = own, tp_size
        self.num_layers, self.num_pages, self.page_size = own.num_layers, own.num_pages, own.page_size
        self.kv_heads, self.head_dim, self.dtype = own.kv_heads, own.head_dim, own.dtype
        shape, self.followers = tuple(own.buffer.shape), []
        for rank in range(1, tp_size):
            path = pool_file(progress_path, rank)
            self.followers.append(map_shared(path, shape, own.dtype))
            os.unlink(path)  # mapped by both processes now: the memory lives as long as they do

    @property
    def device_index(self) -> int:
        return self.own.device_index

    def buffer_infos(self) -> list[BufferInfo]:
        page = self.own.bytes_per_page
        return self.own.buffer_infos() + [
            BufferInfo(b.data_ptr(), b.numel() * b.element_size(), page) for b in self.followers
        ]
