"""EPLB (--enable-eplb): every rank at once, between two forwards, rebalances each MoE layer's expert
placement from the tokens routed to each expert since the last rebalance, and moves the experts' weights
between ranks: an expert a rank gains is broadcast from a rank that held it (no checkpoint read). Each
rank's counts are summed over the group first, so every rank computes the same placement
(common.parallel.experts). A pair (token, expert) is computed with the same weights whichever copy
computes it, so the output does not change; only which rank does the work. A copied expert fuses its own
gate/up weight (common.model.llama.MLP.fuse), as loading did.

Rank 0 starts it every --eplb-rebalance-num-iterations forwards (common.ranks.ranks.Ranks.group_op); a
follower runs it when the step channel says so.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from common.model.moe import SparseMoE, moe_layers
from common.parallel.group import TensorParallel

log = logging.getLogger(__name__)


@torch.inference_mode()
def rebalance_experts(model: nn.Module, tp: TensorParallel) -> int:
    """Rebalance every MoE layer; the experts copied to a new rank."""
    moved = 0
    for moe in moe_layers(model):
        device = moe.gate.weight.device
        loads = tp.all_reduce(moe.loads.to(device)).tolist()
        moe.loads.zero_()
        new = moe.placement.rebalance(loads)
        if new.held != moe.placement.held:
            moved += _move(moe, new.held, tp)
            moe.placement = new
    return moved


def _move(moe: SparseMoE, held: list[list[int]], tp: TensorParallel) -> int:
    """Copy each expert to the ranks that gain it (a broadcast from its first old holder; every rank
    joins, in the same order), then drop the experts this rank no longer holds."""
    old, template, moved = moe.placement, next(iter(moe.experts.values())), 0
    for e in range(old.num_experts):
        gaining = [r for r in range(tp.size) if e in held[r] and e not in old.held[r]]
        if not gaining:
            continue
        src = old.holders(e)[0]
        if tp.rank == src:
            module = moe.experts[str(e)]
        else:
            module = copy.deepcopy(template)
        for p in module.parameters():
            tp.broadcast(p.data, src=src)
        if tp.rank in gaining:
            if module.gate_up is not None:  # the copy's fused gate/up weight is the template's: fuse its own
                module.fuse()
            moe.experts[str(e)] = module
        moved += len(gaining)
    for e in [int(k) for k in moe.experts if int(k) not in held[tp.rank]]:
        del moe.experts[str(e)]
    return moved
