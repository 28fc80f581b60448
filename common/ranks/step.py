"""One forward step, sent from rank 0 to the followers: a header over the host group, then every tensor
of the step's ForwardBatch(es) packed into one int64 payload over the model's group.

    header  [op, step] + per batch [mode, tokens, requests, logits rows, table width] + [LoRA ints]
    payload per batch: input_ids, positions, out_cache_loc, rope_lens [tokens] | seq_lens, extend_lens
            [requests] | logits_indices [logits rows] | the requests' req_to_token rows, [requests x width]
            then the batch's LoRA (--enable-lora; LoraBatch.wire: the adapter in each slot, the segments)

One batch for the whole group (tensor parallelism: every rank runs it), or, under DP attention, one batch
per rank, in rank order: each rank runs its own (zero tokens: an idle batch) and learns every rank's
token and logits-row counts (`DPStep`), which its MoE layers and LM head exchange rows by.

A follower keeps no request table: the rows of this step's requests arrive with it and become its
`req_to_token` (its requests are rows 0..n-1). The KV slots are rank 0's (or, under DP attention, its DP
scheduler's), and every rank's pool has the same pages, so a slot means the same page everywhere. The
follower builds the page metadata from the lengths it received (page_meta.py), reading them on its host
once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.core.forward_batch import DPStep, ForwardBatch, ForwardMode
from common.core.page_meta import build_page_meta
from common.parallel.group import TensorParallel

if TYPE_CHECKING:
    from common.lora.batch import LoraBatch

FIELDS = 5  # per batch in the header
OP_STOP, OP_FORWARD, OP_REBALANCE = 0, 1, 2
MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.VERIFY]


class StepChannel:
    def __init__(
        self, tp: TensorParallel, device: str, page_size: int, lora: Callable[[list[int]], LoraBatch] | None = None
    ):
        """`lora`: a follower's reading of a batch's LoRA wire (common/lora/follower.py)."""
        self.tp, self.device, self.page_size, self.lora = tp, device, page_size, lora
        self.batches = tp.size if tp.dp_attention else 1
        self.header = 2 + FIELDS * self.batches + 1

    def send(self, batches: list[ForwardBatch], step: int) -> None:
        """Rank 0: the batches it is about to run (one, or one per rank under DP attention)."""
        counts, parts = [], []
        for batch in batches:
            width = batch.pages.max_len
            rows = batch.req_to_token[batch.req_pool_indices, :width]
            counts += [
                MODES.index(batch.mode),
                len(batch.input_ids),
                batch.batch_size,
                len(batch.logits_indices),
                width,
            ]
            parts += [batch.input_ids, batch.positions, batch.out_cache_loc, batch.rope_lens]
            parts += [batch.seq_lens, batch.extend_lens, batch.logits_indices, rows.reshape(-1)]
        wire = batches[0].lora.wire if batches[0].lora is not None else None
        parts.append(torch.tensor(wire or [], dtype=torch.int64))
        self.tp.broadcast(torch.tensor([OP_FORWARD, step, *counts, len(wire or [])]), host=True)
        self.tp.broadcast(torch.cat([p.to(self.device, torch.int64) for p in parts]))

    def send_op(self, op: int, step: int = 0) -> None:
        """An operation of the whole group without a batch (stop; EPLB's rebalance)."""
        self.tp.broadcast(torch.tensor([op, step] + [0] * (self.header - 2)), host=True)

    def send_stop(self) -> None:
        self.send_op(OP_STOP)

    def receive(self) -> tuple[int, int, ForwardBatch | None]:
        """A follower: the next step's op, number and (for OP_FORWARD) this rank's batch."""
        header = self.tp.broadcast(torch.zeros(self.header, dtype=torch.int64), host=True).tolist()
        op, step, counts = (
            header[0],
            header[1],
            [header[2 + i * FIELDS : 2 + (i + 1) * FIELDS] for i in range(self.batches)],
        )
        if op != OP_FORWARD:
            return op, step, None
        sizes = [[t] * 4 + [r] * 2 + [n] + [r * w] for _, t, r, n, w in counts]
        lora_ints = header[-1]
        total = sum(map(sum, sizes))
        payload = self.tp.broadcast(torch.empty(total + lora_ints, dtype=torch.int64, device=self.device))
        mine = self.tp.rank if self.tp.dp_attention else 0
        skip = sum(map(sum, sizes[:mine]))
        batch = self._batch(counts[mine], payload[skip : skip + sum(sizes[mine])].split(sizes[mine]))
        if lora_ints:
            batch.lora = self.lora(payload[total:].tolist())
        if self.tp.dp_attention:
            batch.dp = DPStep([c[1] for c in counts], [c[3] for c in counts])
        return op, step, batch

    def _batch(self, counts: list[int], parts: list[torch.Tensor]) -> ForwardBatch:
        mode, _, reqs, _, width = counts
        ids, pos, out, rope_lens, seq_lens, ext, logits_idx, table = parts
        seq_lens, ext = seq_lens.cpu(), ext.cpu()
        pages, _ = build_page_meta(seq_lens.tolist(), ext.tolist(), self.page_size, self.device, [])
        return ForwardBatch(
            mode=MODES[mode],
            input_ids=ids,
            positions=pos,
            out_cache_loc=out,
            req_pool_indices=torch.arange(reqs, device=self.device),
            seq_lens=seq_lens,
            extend_lens=ext,
            logits_indices=logits_idx,
            req_to_token=table.view(reqs, width).to(torch.int32),
            pages=pages,
            rope_lens=rope_lens,
        )
