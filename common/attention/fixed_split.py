"""Batch-invariant attention (--enable-deterministic-inference): a fixed split of the KV sequence.

Every query attends over its request's keys in splits of SPLIT positions counted from position 0, the same
splits whether the query is one of a prefill chunk (of any size), a decode step in a batch of any size, or a
speculative verify. Each split gives a partial (its max, its sum of exponentials, its weighted sum of V) from
products of one shape (SPLIT keys: the same kernel and summation order for every query, common/parallel/
invariant.py), and the partials are combined one split after the other, in position order (the online
softmax). A key past the query is masked to an exact zero, and a split wholly past it leaves the running
sums exactly as they were: so a token's output is the same bits whatever the chunk, the batch, the padding
and the prefix that was cached (FP8 pools included: the dequantization is elementwise).

The queries of one KV head are the rows of one product, [R, Hkv, G x E, D] (G query heads per KV head, E
queries per request), as a decode step, a verify and a prefill chunk alike: a one-row product (one query
head per KV head, one query) is computed as two rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch, ForwardMode
from common.memory.kv_pool import SlotIndex

SPLIT = 256  # keys per split: a power of two that covers a short prompt in one split
FLOOR = -1e30  # the running max before any key: finite, so a split of masked keys leaves the sums exact


@dataclass
class QueryGroup:
    """Requests whose queries go through one product: `rows` [R, E] index the batch's tokens (padding:
    token 0, not written back where `real` [R, E] is False), `pos` [R, 1, G x E, 1] each query row's position,
    `kv_at` the requests' KV slots [R, S] (S a multiple of SPLIT; padding: slot 0, masked)."""

    rows: torch.Tensor
    real: torch.Tensor
    pos: torch.Tensor
    kv_at: SlotIndex


class FixedSplitAttention(AttentionBackend):
    """The torch backend's attention with a fixed KV split (the module docstring): any device, MHA or MLA
    pools, FP8 or not."""

    def init_forward(self, batch: ForwardBatch) -> None:
        self._out = self.kv_pool.locate(batch.out_cache_loc)
        seq_lens, ext = batch.seq_lens.tolist(), batch.extend_lens.tolist()
        starts = [sum(ext[:i]) for i in range(len(ext))]
        requests = list(range(len(ext)))
        if batch.mode == ForwardMode.EXTEND:  # one product per request: chunks of very different lengths
            self._groups = [self._group(batch, [i], starts, seq_lens, ext) for i in requests]
        else:  # decode (one query each) and verify (a few): one product for the batch
            self._groups = [self._group(batch, requests, starts, seq_lens, ext)]

    def _group(self, batch: ForwardBatch, reqs: list[int], starts: list[int], seq_lens: list[int], ext: list[int]):
        device = batch.req_to_token.device
        lens, new = torch.tensor([seq_lens[i] for i in reqs]), torch.tensor([ext[i] for i in reqs])
        within = torch.arange(int(new.max()))
        real = within[None, :] < new[:, None]
        rows = torch.where(real, torch.tensor([starts[i] for i in reqs])[:, None] + within[None, :], 0)
        pos = (lens - new)[:, None] + within[None, :]
        pos = pos.repeat(1, self.num_q_heads // self.kv_pool.kv_heads)[:, None, :, None]  # rows: (head, query)
        s = -(-int(lens.max()) // SPLIT) * SPLIT
        table = batch.req_to_token[batch.req_pool_indices[reqs], : min(s, batch.req_to_token.shape[1])].long()
        table = F.pad(table, (0, s - table.shape[1]))
        valid = torch.arange(s, device=device)[None, :] < lens.to(device)[:, None]
        at = self.kv_pool.locate(torch.where(valid, table, 0))  # slot 0 is the padding page
        return QueryGroup(rows.to(device), real.to(device), pos.to(device), at)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = self.kv_pool
        pool.set_kv(layer_id, self._out, k, v)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # MLA: V (the latent) is narrower than Q and K
        for g in self._groups:
            keys, vals = split_kv(pool.k_at(layer_id, g.kv_at), pool.v_at(layer_id, g.kv_at))
            (r, e), hkv, d = g.rows.shape, keys.shape[1], q.shape[-1]
            qg = q[g.rows].float().view(r, e, hkv, -1, d).permute(0, 2, 3, 1, 4)  # [R, Hkv, G, E, D]
            og = split_attention((qg * self.scaling).reshape(r, hkv, -1, d).contiguous(), keys, vals, g.pos)
            og = og.view(r, hkv, -1, e, og.shape[-1]).permute(0, 3, 1, 2, 4).reshape(r, e, self.num_q_heads, -1)
            out[g.rows[g.real]] = og[g.real].to(out.dtype)
        return out


def split_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered K and V [R, S, H, D] (S a multiple of SPLIT) as split_attention's float32 operands: keys
    [R, H, S / SPLIT, D, SPLIT] and values [R, H, S / SPLIT, SPLIT, Dv], each split contiguous."""

    def splits(x: torch.Tensor) -> torch.Tensor:
        r, s, h, d = x.shape
        return x.float().view(r, s // SPLIT, SPLIT, h, d).permute(0, 3, 1, 2, 4)

    return splits(k).transpose(-1, -2).contiguous(), splits(v).contiguous()


def split_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T) V over SPLIT keys at a time, in order. q [R, H, M, D] (scaled, contiguous), keys
    [R, H, N, D, SPLIT] and vals [R, H, N, SPLIT, Dv], each split contiguous (a transposed operand, or another
    M, would change the product's summation order: benchmarks/batch_invariance.py); keys past a query's
    position in `pos` [R, 1, M, 1] are masked (the padding of the last split too)."""
    if q.shape[2] == 1:  # a one-row product takes another kernel: compute the row twice
        return split_attention(torch.cat([q, q], 2), keys, vals, torch.cat([pos, pos], 2))[:, :, :1]
    r, h, m, _ = q.shape
    acc = q.new_zeros(r, h, m, vals.shape[-1])
    total, top = q.new_zeros(r, h, m, 1), q.new_full((r, h, m, 1), FLOOR)
    for n in range(keys.shape[2]):
        scores = torch.matmul(q, keys[:, :, n])
        key_pos = torch.arange(n * SPLIT, (n + 1) * SPLIT, device=q.device)
        scores = scores.masked_fill(key_pos > pos, float("-inf"))
        split_top = scores.amax(-1, keepdim=True).clamp(min=FLOOR)
        p = torch.exp(scores - split_top)
        new_top = torch.maximum(top, split_top)
        old, new = torch.exp(top - new_top), torch.exp(split_top - new_top)
        acc = acc * old + torch.matmul(p, vals[:, :, n]) * new
        total = total * old + p.sum(-1, keepdim=True) * new
        top = new_top
    return acc / total
