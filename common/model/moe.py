"""The mixture-of-experts layer shared by Qwen3-MoE, Mixtral and DeepSeek: a router picks each token's
top-k experts and their weights (common.model.routing), every chosen expert (a gated SiLU MLP) runs on
the tokens routed to it, and the weighted outputs are summed per token, plus DeepSeek's shared experts.

Experts are kept one module each, named as the checkpoints name them (`experts.{i}.gate_proj`), so a
safetensors directory loads as it is; experts run in ascending order, as transformers runs them.

Over several ranks (the router gate is whole on each, so every rank routes alike):

    TP-MoE (default)  every rank keeps every expert's slice of the intermediate features (the shared experts
                      too) and computes every token; the partial sums are all-reduced once per layer
    EP (--ep-size N)  every rank keeps whole experts (common.parallel.experts: which, with redundant copies);
                      it computes the pairs (token, expert) it owns and the sums are all-reduced; the shared
                      experts are whole on every rank and added after the reduction
    DP attention      every rank has its own tokens (`batch.dp`). EP dispatches each token to the ranks
                      owning its experts and combines their sums back (all-to-all); TP-MoE all-gathers every
                      rank's tokens and reduce-scatters the sums. A rank without tokens still joins both
                      (an idle batch: zero rows). The shared experts run whole on the rank's own tokens.

`loads` counts the tokens routed to each expert (EPLB's measurement, with --enable-eplb).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.core.forward_batch import ForwardBatch
from common.model.llama import MLP
from common.parallel import invariant
from common.parallel.experts import ExpertPlacement
from common.parallel.group import SINGLE, TensorParallel
from common.parallel.layers import linear


class RouterGate(nn.Module):
    """The router's linear weight (and DeepSeek-V3's score-correction bias), named as in checkpoints."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if correction_bias else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 router logits, whatever the weights' dtype."""
        if invariant.enabled():  # oneDNN's product: MKL's (F.linear's) float32 rows change with the batch size
            return linear(x.float(), self.weight.float())
        return F.linear(x.float(), self.weight.float())


Route = Callable[[RouterGate, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class SparseMoE(nn.Module):
    """`route(gate, x)` is the family's rule (common.model.routing): (weights [T, k], expert ids [T, k])."""

    takes_batch = True  # the decoder layer passes the batch (its DP token counts)

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        gate: RouterGate,
        route: Route,
        tp: TensorParallel = SINGLE,
        redundant: int = 0,
    ) -> None:
        super().__init__()
        self.gate, self.route, self.tp = gate, route, tp
        self.placement = ExpertPlacement.initial(num_experts, tp.size if tp.ep else 1, redundant)
        mine = self.placement.held[tp.rank if tp.ep else 0]
        self.experts = nn.ModuleDict({str(e): self.expert(hidden, intermediate) for e in mine})
        self.shared_experts: MLP | None = None
        self.shared_reduced = not (tp.ep or tp.dp_attention)  # sliced and in the all-reduce, else whole
        self.count_loads = False
        self.loads = torch.zeros(num_experts, dtype=torch.int64, device="cpu")  # not on the meta device of loading

    def expert(self, hidden: int, intermediate: int) -> MLP:
        """An expert of this rank: whole (EP), or its intermediate slice, reduced by forward."""
        return MLP(hidden, intermediate, tp=SINGLE if self.tp.ep else self.tp, reduce=False)

    def make_shared(self, hidden: int, intermediate: int) -> None:
        """DeepSeek's shared experts: sliced and in the all-reduce (TP-MoE), else whole on every rank."""
        self.shared_experts = MLP(hidden, intermediate, tp=self.tp if self.shared_reduced else SINGLE, reduce=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        dp = batch.dp if batch is not None else None
        if dp is None:  # every rank has the same tokens
            weights, chosen = self._route(x)
            owner = self.placement.owner(chosen, torch.arange(len(x))) if self.placement.ranks > 1 else None
            out = self._experts_out(x, weights, chosen, owner)
            if self.shared_experts is not None and self.shared_reduced:
                out = out + self.shared_experts(x)
            out = self.tp.all_reduce(out)
        elif self.tp.ep:
            out = self._dispatch_combine(x, *self._route(x))
        else:
            everyone = self.tp.all_gather_rows(x, dp.tokens)
            out = self.tp.reduce_scatter_rows(self._experts_out(everyone, *self._route(everyone)), dp.tokens)
        if self.shared_experts is not None and not self.shared_reduced:
            out = out + self.shared_experts(x)
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = self.route(self.gate, x)
        if self.count_loads:
            self.loads += torch.bincount(chosen.flatten(), minlength=len(self.loads)).cpu()
        return weights, chosen

    def _experts_out(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, owner: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The weighted sum of this rank's experts (or slices) over the pairs it computes: where `owner` is
        given, those it names this rank for; expert ids not held here (-1: none) are skipped."""
        out = torch.zeros_like(x)
        for expert_id in torch.unique(chosen).tolist():
            expert = self.experts[str(expert_id)] if str(expert_id) in self.experts else None
            if expert is None:
                continue
            mine = chosen == expert_id
            if owner is not None:
                mine &= owner == self.tp.rank
            token, slot = torch.where(mine)
            if len(token):
                y = expert(x[token]) * weights[token, slot, None]
                out.index_add_(0, token, y.to(out.dtype))
        return out

    def _dispatch_combine(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """EP under DP attention: each token goes once to every rank owning one of its pairs, with those
        pairs' expert ids and weights (-1 / 0 for the others); each rank sums its experts' outputs per
        token and sends the sums back, added into the token's row."""
        k, tp = chosen.shape[1], self.tp
        owner = self.placement.owner(chosen, torch.arange(len(x)))
        rows, meta, sent = [], [], []
        for r in range(tp.size):
            pairs = owner == r
            token = torch.where(pairs.any(dim=1))[0]
            ids = torch.where(pairs[token], chosen[token], -1)
            w = torch.where(pairs[token], weights[token], 0.0)
            rows.append(token)
            meta.append(torch.cat((ids.float(), w.float()), dim=1))
            sent.append(len(token))
        token = torch.cat(rows)
        send = torch.tensor(sent, dtype=torch.int64, device=x.device)
        recv = tp.all_to_all_counts(send).tolist()
        got_x = tp.all_to_all_rows(x[token], sent, recv)
        got_meta = tp.all_to_all_rows(torch.cat(meta), sent, recv)
        y = self._experts_out(got_x, got_meta[:, k:], got_meta[:, :k].long())
        back = tp.all_to_all_rows(y, recv, sent)
        return torch.zeros_like(x).index_add_(0, token, back)


def moe_layers(model: nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def expert_placement(model: nn.Module) -> dict[int, list[list[int]]]:
    """Each MoE layer's experts held by each rank (every rank computes the same placement), by layer."""
    return {
        int(name.split(".")[2]): m.placement.held
        for name, m in model.named_modules()
        if isinstance(m, SparseMoE) and m.placement.ranks > 1
    }
