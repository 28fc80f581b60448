"""Which experts each token goes to, and with what weight: the routing rules of the MoE families.

Each rule takes the router gate (common.model.moe.RouterGate) and the hidden states [T, hidden] and
returns (weights [T, k] float32, expert ids [T, k]).

    softmax_topk   Qwen3-MoE, Mixtral: softmax over experts, top k, renormalised when norm_topk_prob
    grouped_topk   DeepSeek-V2 (greedy / group_limited_greedy) and V3 (noaux_tc: sigmoid scores plus
                   e_score_correction_bias choose, the uncorrected scores weigh), then x routed_scaling_factor
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import PretrainedConfig

SUPPORTED_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def softmax_topk(gate, x: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(gate.logits(x), dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """[T, E] True for the experts of each token's `topk_group` best groups."""
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)
    scores = grouped.max(dim=-1).values if group_score == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)
    return mask[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)


def grouped_topk(gate, x: torch.Tensor, config: PretrainedConfig) -> tuple[torch.Tensor, torch.Tensor]:
    method, top_k = deepseek_topk_method(config), config.num_experts_per_tok
    logits = gate.logits(x)
    if method == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores + gate.e_score_correction_bias.float()
        choice = choice.masked_fill(~_group_mask(choice, config.n_group, config.topk_group, "top2"), float("-inf"))
        chosen = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
    else:
        scores = logits.softmax(dim=-1)
        if method == "group_limited_greedy":
            scores = scores.masked_fill(~_group_mask(scores, config.n_group, config.topk_group, "max"), 0.0)
        weights, chosen = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    if getattr(config, "norm_topk_prob", False) and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, chosen


def deepseek_topk_method(config: PretrainedConfig) -> str:
    """V3 configs name "noaux_tc"; transformers' V3 config has no field for it and always means it."""
    method = getattr(config, "topk_method", None) or "noaux_tc"
    if method not in SUPPORTED_TOPK_METHODS:
        raise ValueError(f"topk_method {method!r} is not supported; supported: {', '.join(SUPPORTED_TOPK_METHODS)}")
    return method


def softmax_router(config: PretrainedConfig, renormalize: bool):
    return partial(softmax_topk, top_k=config.num_experts_per_tok, renormalize=renormalize)


def deepseek_router(config: PretrainedConfig):
    return partial(grouped_topk, config=config)
