"""The mixture-of-experts layer shared by Qwen3-MoE, Mixtral and DeepSeek: a router picks each token's
top-k experts and their weights (common.model.routing), every chosen expert (a gated SiLU MLP) runs on
the tokens routed to it, and the weighted outputs are summed per token, plus DeepSeek's shared experts.

Experts are kept one module each, named as the checkpoints name them (`experts.{i}.gate_proj`), so a
safetensors directory loads as it is; experts run in ascending order, as transformers runs them.

Tensor parallelism (SGLang's TP-MoE, not expert parallelism): every rank keeps every expert's slice of
the intermediate features (gate/up rows, down columns; the shared experts too) and the whole router
gate, so every rank routes alike and does the same work whatever the routing; the partial sums of all
experts are all-reduced once per layer. Whole experts per rank would leave ranks idle when the few
tokens of a step pick one rank's experts, and would need an all-to-all of the tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.model.llama import MLP
from common.parallel.group import SINGLE, TensorParallel


class RouterGate(nn.Module):
    """The router's linear weight (and DeepSeek-V3's score-correction bias), named as in checkpoints."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if correction_bias else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 router logits, whatever the weights' dtype."""
        return F.linear(x.float(), self.weight.float())


Route = Callable[[RouterGate, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class SparseMoE(nn.Module):
    """`route(gate, x)` is the family's rule (common.model.routing): (weights [T, k], expert ids [T, k])."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        gate: RouterGate,
        route: Route,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.gate, self.route, self.tp = gate, route, tp
        self.experts = nn.ModuleList(self.expert(hidden, intermediate) for _ in range(num_experts))
        self.shared_experts: MLP | None = None

    def expert(self, hidden: int, intermediate: int) -> MLP:
        """An expert (or the shared experts) of this rank: its intermediate slice, reduced by forward."""
        return MLP(hidden, intermediate, tp=self.tp, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(self.gate, x)
        out = torch.zeros_like(x)
        for expert_id in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == expert_id)
            y = self.experts[expert_id](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)
