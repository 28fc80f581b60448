"""CUDA attention with FlashInfer's paged prefill/decode kernels, reading the pool's pages in place.

The page-major pool gives each layer as a [num_pages + 1, H, page_size, D] view strided across pages
and heads (FlashInfer's HND paged layout; its kernels take the strides); page ids come from req_to_token.

The kernel family is pinned (`--flashinfer-backend`, default fa2, as SGLang and mini-sglang pin it):
FlashInfer's "auto" builds FA3's kernels on Hopper besides FA2's (for the tensor-core decode), several
ten-file nvcc builds on a first start instead of two.
"""

from __future__ import annotations

import torch

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch, ForwardMode
from common.core.page_meta import page_indices

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferAttention(AttentionBackend):
    def __init__(self, kv_pool, num_q_heads: int, head_dim: int, scaling: float, backend: str = "fa2"):
        super().__init__(kv_pool, num_q_heads, head_dim, scaling)
        import flashinfer

        device = kv_pool.buffer.device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.backend = backend
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND", backend=backend)
        self.use_tensor_cores = num_q_heads // kv_pool.kv_heads >= 4
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_tensor_cores=self.use_tensor_cores, backend=backend
        )
        self.page_size = kv_pool.page_size

    def init_forward(self, batch: ForwardBatch) -> None:
        """plan() reads the indptr arrays on the host (the pinned views: no read back from the device)
        and copies them to its buffers; the page ids are gathered on the device."""
        meta = batch.pages
        indptr, last_len = meta.kv_indptr, meta.last_page_len
        indices = page_indices(meta, batch.req_pool_indices, batch.req_to_token, self.page_size)
        pool = self.kv_pool
        self._out = pool.locate(batch.out_cache_loc)
        common = dict(sm_scale=self.scaling, q_data_type=pool.dtype, kv_data_type=pool.dtype)
        if batch.mode == ForwardMode.DECODE:
            self.decode.plan(
                indptr,
                indices,
                last_len,
                self.num_q_heads,
                pool.kv_heads,
                self.head_dim,
                self.page_size,
                pos_encoding_mode="NONE",
                **common,
            )
            return
        self.prefill.plan(
            meta.qo_indptr,
            indptr,
            indices,
            last_len,
            self.num_q_heads,
            pool.kv_heads,
            self.head_dim,
            self.page_size,
            causal=True,
            **common,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = self.kv_pool
        pool.set_kv(layer_id, self._out, k, v)
        cache = (pool.k_pages(layer_id), pool.v_pages(layer_id))
        q = q.to(pool.dtype).contiguous()
        wrapper = self.decode if batch.mode == ForwardMode.DECODE else self.prefill
        return wrapper.run(q, cache)
