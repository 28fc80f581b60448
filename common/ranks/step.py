"""One forward step, sent from rank 0 to the followers: a header over the host group, then every tensor
of the ForwardBatch packed into one int64 payload over the model's group.

    header  [op, mode, tokens, requests, logits rows, table width, step]
    payload input_ids, positions, out_cache_loc, rope_lens [tokens] | seq_lens, extend_lens [requests] |
            logits_indices [logits rows] | the requests' req_to_token rows, [requests x table width]

A follower keeps no request table: the rows of this step's requests arrive with it and become its
`req_to_token` (its requests are rows 0..n-1). The KV slots are rank 0's, and every rank's pool has the
same pages, so a slot means the same page everywhere. The follower builds the page metadata from the
lengths it received (page_meta.py), reading them on its host once per step.
"""

from __future__ import annotations

import torch

from common.core.forward_batch import ForwardBatch, ForwardMode
from common.core.page_meta import build_page_meta
from common.parallel.group import TensorParallel

HEADER = 7
OP_STOP, OP_FORWARD = 0, 1
MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.VERIFY]


class StepChannel:
    def __init__(self, tp: TensorParallel, device: str, page_size: int):
        self.tp, self.device, self.page_size = tp, device, page_size

    def send(self, batch: ForwardBatch, step: int) -> None:
        """Rank 0: the batch it is about to run."""
        width = batch.pages.max_len
        rows = batch.req_to_token[batch.req_pool_indices, :width]
        counts = (len(batch.input_ids), batch.batch_size, len(batch.logits_indices), width, step)
        self.tp.broadcast(torch.tensor([OP_FORWARD, MODES.index(batch.mode), *counts]), host=True)
        parts = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.rope_lens]
        parts += [batch.seq_lens, batch.extend_lens, batch.logits_indices, rows.reshape(-1)]
        self.tp.broadcast(torch.cat([p.to(self.device, torch.int64) for p in parts]))

    def send_stop(self) -> None:
        self.tp.broadcast(torch.tensor([OP_STOP] + [0] * (HEADER - 1)), host=True)

    def receive(self) -> tuple[int, ForwardBatch | None]:
        """A follower: the next step's number and batch; None when rank 0 stops the ranks."""
        header = self.tp.broadcast(torch.zeros(HEADER, dtype=torch.int64), host=True).tolist()
        op, mode, tokens, reqs, logits, width, step = header
        if op == OP_STOP:
            return step, None
        sizes = [tokens] * 4 + [reqs] * 2 + [logits] + [reqs * width]
        payload = self.tp.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=self.device))
        ids, pos, out, rope_lens, seq_lens, ext, logits_idx, table = payload.split(sizes)
        seq_lens, ext = seq_lens.cpu(), ext.cpu()
        pages, _ = build_page_meta(seq_lens.tolist(), ext.tolist(), self.page_size, self.device, [])
        return step, ForwardBatch(
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
