"""Rank 0's model: called like the model, it first sends the batch to the follower ranks, which run the
same forward on their shards; the collectives inside the layers then meet on every rank."""

from __future__ import annotations

import torch

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch
from common.model.llama import LlamaForCausalLM
from common.ranks.ranks import Ranks


class LeaderModel:
    def __init__(self, model: LlamaForCausalLM, ranks: Ranks):
        self.model, self.ranks = model, ranks

    def __call__(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        return self.ranks.forward(batch, lambda: self.model(batch, attn))
