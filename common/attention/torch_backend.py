"""Reference attention on any device: gather each request's KV slots (dequantized when the pool is FP8),
then SDPA. Serves MHA pools and MLA's latent pool (one KV head; V narrower than K).

With one KV head and several query heads (MLA) the heads are folded into the query rows, [1, H x T, D]
against [1, S, D]: SDPA's GQA path (and a broadcast matmul) would copy the one K and V once per head,
H x S x D per layer, which on the CPU costs more than the attention (benchmarks/mla_attention.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch, ForwardMode


class TorchAttention(AttentionBackend):
    def __init__(self, kv_pool, num_q_heads: int, head_dim: int, scaling: float):
        super().__init__(kv_pool, num_q_heads, head_dim, scaling)
        self.fold_heads = kv_pool.kv_heads == 1 and num_q_heads > 1

    def init_forward(self, batch: ForwardBatch) -> None:
        rows, pool = batch.req_pool_indices, self.kv_pool
        self._out = pool.locate(batch.out_cache_loc)
        if batch.mode == ForwardMode.DECODE:
            meta = batch.pages  # lengths' extremes on the host: nothing read back from the device
            table = batch.req_to_token[rows, : meta.max_len].long()
            valid = torch.arange(meta.max_len, device=table.device)[None, :] < meta.seq_lens[:, None]
            self._kv_at = pool.locate(torch.where(valid, table, 0))  # slot 0 is the padding page
            # no mask when every row is full length: the same SDPA kernel as transformers' (bit-equal outputs)
            self._decode_mask = None if meta.min_len == meta.max_len else valid[:, None, None, :]  # [B, 1, 1, S]
            return
        self._extend = []
        start = 0
        for i, (seq_len, ext) in enumerate(zip(batch.seq_lens.tolist(), batch.extend_lens.tolist())):
            kv_index = batch.req_to_token[rows[i], :seq_len].long()
            q_pos = torch.arange(seq_len - ext, seq_len, device=kv_index.device)
            causal = torch.arange(seq_len, device=kv_index.device)[None, :] <= q_pos[:, None]
            mask = None if ext == seq_len else causal
            if self.fold_heads:  # rows are (head, position): the causal mask once per head
                mask = causal.repeat(self.num_q_heads, 1)
            self._extend.append((start, ext, pool.locate(kv_index), mask))
            start += ext

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = self.kv_pool
        pool.set_kv(layer_id, self._out, k, v)
        if batch.mode == ForwardMode.DECODE:
            keys = pool.k_at(layer_id, self._kv_at).transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
            vals = pool.v_at(layer_id, self._kv_at).transpose(1, 2).to(q.dtype)
            if self.fold_heads:  # [B, 1, H, D] against [B, 1, S, D]
                out = F.scaled_dot_product_attention(
                    q[:, None], keys, vals, attn_mask=self._decode_mask, scale=self.scaling
                )
                return out[:, 0]
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], keys, vals, attn_mask=self._decode_mask, scale=self.scaling, enable_gqa=True
            )
            return out[:, :, 0, :]
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # MLA: V (the latent) is narrower than Q and K
        for start, ext, kv_at, mask in self._extend:
            # 4-d like transformers': SDPA's 3-d path rounds bf16 differently
            keys = pool.k_at(layer_id, kv_at).transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, S, D]
            vals = pool.v_at(layer_id, kv_at).transpose(0, 1)[None].to(q.dtype)
            qi = q[start : start + ext].transpose(0, 1)[None]  # [1, Hq, E, D]
            if self.fold_heads:
                qi = qi.reshape(1, 1, -1, qi.shape[-1])
            oi = F.scaled_dot_product_attention(
                qi, keys, vals, attn_mask=mask, is_causal=mask is None, scale=self.scaling, enable_gqa=True
            )
            out[start : start + ext] = oi.view(self.num_q_heads, ext, -1).transpose(0, 1)
        return out
