"""Rank 0's model: called like the model, it first sends the batch to the follower ranks, which run the
same forward on their shards; the collectives inside the layers then meet on every rank.

Under DP attention (`DPForward`) each rank runs its own DP scheduler's batch: rank 0 sends every rank its
batch (an idle one, of no tokens, to a rank with nothing to run) and gets back the logits of every rank's
rows. With --enable-eplb, every --eplb-rebalance-num-iterations forwards the ranks first rebalance their
experts (`ExpertRebalancer`, common.model.eplb).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from common.attention.base import AttentionBackend
from common.core.forward_batch import DPStep, ForwardBatch, ForwardMode
from common.core.page_meta import build_page_meta
from common.model.eplb import rebalance_experts
from common.model.llama import LlamaForCausalLM
from common.ranks.ranks import Ranks
from common.ranks.step import OP_REBALANCE

log = logging.getLogger(__name__)


class ExpertRebalancer:
    def __init__(self, ranks: Ranks, model: LlamaForCausalLM, every: int):
        self.ranks, self.model, self.every = ranks, model, every
        self.forwards = self.rebalances = self.moved = 0

    def tick(self) -> None:
        """Count a forward; rebalance every group's experts before each `every`-th."""
        self.forwards += 1
        if self.forwards % self.every:
            return
        moved = self.ranks.group_op(OP_REBALANCE, lambda: rebalance_experts(self.model, self.ranks.tp))
        self.rebalances += 1
        self.moved += moved
        log.info("EPLB rebalance %d: %d expert copies moved between ranks", self.rebalances, moved)

    def info(self) -> dict:
        return {"rebalances": self.rebalances, "experts_moved": self.moved}


class LeaderModel:
    def __init__(self, model: LlamaForCausalLM, ranks: Ranks, rebalancer: ExpertRebalancer | None = None):
        self.model, self.ranks, self.rebalancer = model, ranks, rebalancer

    def __call__(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        if self.rebalancer is not None:
            self.rebalancer.tick()
        return self.ranks.forward([batch], lambda: self.model(batch, attn))


def idle_batch(req_to_token: torch.Tensor, page_size: int, device: str) -> ForwardBatch:
    """A batch of no tokens: what a DP rank with nothing to run joins the step's collectives with."""
    pages, _ = build_page_meta([], [], page_size, device, [])
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=empty,
        positions=empty,
        out_cache_loc=empty,
        req_pool_indices=empty,
        seq_lens=torch.zeros(0, dtype=torch.int64),
        extend_lens=torch.zeros(0, dtype=torch.int64),
        logits_indices=empty,
        req_to_token=req_to_token,
        pages=pages,
        rope_lens=empty,
    )


class DPForward:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: AttentionBackend,
        ranks: Ranks,
        idle: ForwardBatch,
        rebalancer: ExpertRebalancer | None = None,
    ):
        self.model, self.attn, self.ranks, self.idle, self.rebalancer = model, attn, ranks, idle, rebalancer
        self.size = ranks.tp.size
        self.load = [0] * self.size  # tokens each DP rank ran (per-rank load)

    def forward(self, batches: list[ForwardBatch | None]) -> list[torch.Tensor]:
        """One forward of every DP rank's batch (None: idle); each rank's logits, in rank order."""
        if self.rebalancer is not None:
            self.rebalancer.tick()
        batches = [b if b is not None else self.idle for b in batches]
        step = DPStep([len(b.input_ids) for b in batches], [len(b.logits_indices) for b in batches])
        for r, n in enumerate(step.tokens):
            self.load[r] += n
        own = dataclasses.replace(batches[0], dp=step)

        def run() -> torch.Tensor:
            if step.tokens[0]:
                self.attn.init_forward(own)
            return self.model(own, self.attn)

        return list(self.ranks.forward(batches, run).split(step.rows))

    def forward_one(self, rank: int, batch: ForwardBatch) -> torch.Tensor:
        """DP rank `rank`'s batch alone, the others idle (warm-up, a DP scheduler's own runs)."""
        batches: list[ForwardBatch | None] = [None] * self.size
        batches[rank] = batch
        return self.forward(batches)[rank]
