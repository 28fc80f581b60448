"""One forward step, sent from rank 0 to the followers: a header over the host group, then every tensor
of the ForwardBatch packed into one int64 payload over the model's group.

    header  [op, mode, tokens, requests, logits rows, table width, has full_lens, step]
    payload input_ids, positions, out_cache_loc [tokens] | seq_lens, extend_lens [requests] |
            logits_indices [logits rows] | full_lens [requests, if any] | the requests' req_to_token
            rows, [requests x table width]

A follower keeps no request table: the rows of this step's requests arrive with it and become its
`req_to_token` (its requests are rows 0..n-1). The KV slots are rank 0's, and every rank's pool has the
same pages, so a slot means the same page everywhere.
"""

from __future__ import annotations

import torch

from common.core.forward_batch import ForwardBatch, ForwardMode
from common.parallel.group import TensorParallel

HEADER = 8
OP_STOP, OP_FORWARD = 0, 1
MODES = [ForwardMode.EXTEND, ForwardMode.DECODE]


class StepChannel:
    def __init__(self, tp: TensorParallel, device: str):
        self.tp, self.device = tp, device

    def send(self, batch: ForwardBatch, step: int) -> None:
        """Rank 0: the batch it is about to run."""
        width = int(batch.seq_lens.max())
        rows = batch.req_to_token[batch.req_pool_indices, :width]
        full = batch.full_lens is not None
        counts = (len(batch.input_ids), batch.batch_size, len(batch.logits_indices), width, int(full), step)
        self.tp.broadcast(torch.tensor([OP_FORWARD, MODES.index(batch.mode), *counts]), host=True)
        parts = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.seq_lens, batch.extend_lens]
        parts += [batch.logits_indices, *([batch.full_lens] if full else []), rows.reshape(-1)]
        self.tp.broadcast(torch.cat([p.to(self.device, torch.int64) for p in parts]))

    def send_stop(self) -> None:
        self.tp.broadcast(torch.tensor([OP_STOP] + [0] * (HEADER - 1)), host=True)

    def receive(self) -> tuple[int, ForwardBatch | None]:
        """A follower: the next step's number and batch; None when rank 0 stops the ranks."""
        header = self.tp.broadcast(torch.zeros(HEADER, dtype=torch.int64), host=True).tolist()
        op, mode, tokens, reqs, logits, width, full, step = header
        if op == OP_STOP:
            return step, None
        sizes = [tokens] * 3 + [reqs] * 2 + [logits] + [reqs] * full + [reqs * width]
        payload = self.tp.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=self.device))
        ids, pos, out, seq_lens, ext, logits_idx, *rest = payload.split(sizes)
        return step, ForwardBatch(
            mode=MODES[mode],
            input_ids=ids,
            positions=pos,
            out_cache_loc=out,
            req_pool_indices=torch.arange(reqs, device=self.device),
            seq_lens=seq_lens.cpu(),
            extend_lens=ext.cpu(),
            logits_indices=logits_idx,
            req_to_token=rest[-1].view(reqs, width).to(torch.int32),
            full_lens=rest[0].cpu() if full else None,
        )
