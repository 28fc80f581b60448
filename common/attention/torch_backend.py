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
        if batch.mode == ForwardMode.VERIFY:
            self._init_verify(batch)
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

    def _init_verify(self, batch: ForwardBatch) -> None:
        """A few new tokens per request (a speculative verify, a draft step): one padded SDPA for the whole
        batch, as a decode step with E queries per request, instead of one call per request."""
        meta, device = batch.pages, batch.req_to_token.device
        ext = batch.extend_lens.to(device)
        e, s = int(batch.extend_lens.max()), meta.max_len
        table = batch.req_to_token[batch.req_pool_indices, :s].long()
        keys = torch.arange(s, device=device)
        valid = keys[None, :] < meta.seq_lens[:, None]  # [B, S]
        q_pos = (meta.seq_lens - ext)[:, None] + torch.arange(e, device=device)[None, :]  # [B, E]
        mask = valid[:, None, :] & (keys[None, None, :] <= q_pos[:, :, None])  # [B, E, S]
        if self.fold_heads:  # rows are (head, position)
            mask = mask.repeat(1, self.num_q_heads, 1)
        self._kv_at = pool_at = self.kv_pool.locate(torch.where(valid, table, 0))
        self._verify = (pool_at, mask[:, None], e)
        in_req = torch.arange(int(ext.sum()), device=device) - torch.repeat_interleave(ext.cumsum(0) - ext, ext)
        self._verify_rows = torch.repeat_interleave(torch.arange(len(ext), device=device), ext) * e + in_req

    def _verify_attention(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q [T, H, D] of the batch's tokens -> [T, H, Dv], through the padded [B, H, E, D] layout."""
        pool, (kv_at, mask, e) = self.kv_pool, self._verify
        b, h = mask.shape[0], self.num_q_heads
        keys = pool.k_at(layer_id, kv_at).transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
        vals = pool.v_at(layer_id, kv_at).transpose(1, 2).to(q.dtype)
        padded = q.new_zeros(b * e, h, q.shape[-1]).index_copy_(0, self._verify_rows, q)
        padded = padded.view(b, e, h, -1).transpose(1, 2)  # [B, H, E, D]
        if self.fold_heads:
            padded = padded.reshape(b, 1, h * e, -1)
        out = F.scaled_dot_product_attention(padded, keys, vals, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        out = out.reshape(b, h, e, -1).transpose(1, 2).reshape(b * e, h, -1)
        return out[self._verify_rows]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = self.kv_pool
        pool.set_kv(layer_id, self._out, k, v)
        if batch.mode == ForwardMode.VERIFY:
            return self._verify_attention(q, layer_id)
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
