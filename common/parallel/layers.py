"""Tensor-parallel layers, usable by any model: each holds one rank's shard of a checkpoint tensor and
says which (`shards()`: parameter name -> Shard), so the loader reads only that slice.

    ColumnParallelLinear   output features split: y_local = x W_local^T + b_local (no communication)
    RowParallelLinear      input features split: y = all_reduce(x_local W_local^T) + b
    VocabParallelEmbedding rows of the (padded) vocabulary split: each rank looks up its ids, all-reduce
    ParallelLMHead         logits of this rank's vocabulary rows, all-gathered and cut to the vocabulary

With the group of one rank (`SINGLE`) each is the single-device operation, with no communication.

`linear` is the one matrix product they (and the models' fused projections) call: on the CPU in float32 it
is oneDNN's, which PyTorch uses for bfloat16 but not for float32 (that goes to MKL, whose float32 GEMV
and small-batch GEMM take a slow path on AMD CPUs: a decode step of the built-in model up to 1.4x slower,
docs/performance.md). Elsewhere it is `F.linear`. With --enable-deterministic-inference a one-row product is
computed as two rows on the CPU, and every product in fixed tiles of rows on CUDA (common/parallel/invariant.py:
the same kernel for every batch size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.parallel import invariant
from common.parallel.group import SINGLE, TensorParallel
from common.parallel.partition import padded_vocab, split

ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b, as F.linear; on the CPU in float32 through oneDNN (the module docstring says why)."""
    if invariant.enabled() and (len(x) == 1 or x.device.type != "cpu"):
        return invariant.rows(lambda rows: _linear(rows, weight, bias), x)
    return _linear(x, weight, bias)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if ONEDNN_LINEAR and x.dtype == torch.float32 and x.device.type == "cpu" and weight.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class Shard:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a checkpoint tensor of shape `full_shape`;
    `stop` past the end: the rows beyond it are padding, zero."""

    dim: int
    start: int
    stop: int
    full_shape: tuple[int, ...]


class QuantizableLinear(nn.Module):
    """The product both parallel linears compute: `linear` on a full-precision weight or, once the loader
    set `quant` (common.quant.prepare), the quantized method over the FP8 weight and its scale (the
    parameter the method names: `weight_scale_inv` for DeepSeek's blocks, `weight_scale` for compressed-tensors',
    `weight_groups` for 4-bit weights)."""

    quant = None  # a linear method (common.quant.fp8_block.BlockFP8) for a quantized weight
    int4_shares: dict[str, Shard] | None = None  # a 4-bit layer's checkpoint tensors' (common.quant.int4_prepare)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is None:
            return linear(x, self.weight, bias)
        scale = getattr(self, self.quant.scale_name)
        if invariant.enabled() and x.device.type != "cpu":  # FP8 / 4-bit GEMMs in fixed tiles too (invariant.py)
            return invariant.tiled(lambda rows: self.quant.apply(rows, self.weight, scale, bias), x)
        return self.quant.apply(x, self.weight, scale, bias)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` as a tensor of its own (MLA's absorbed products read it whole)."""
        if self.quant is None:
            return self.weight
        return self.quant.dequantize(self.weight, getattr(self, self.quant.scale_name), dtype, reuse=False)

    def quant_shards(self, out: dict[str, Shard]) -> dict[str, Shard]:
        """`out` with the scale's shard beside the weight's (a 4-bit layer: its checkpoint tensors' instead)."""
        if self.int4_shares is not None:
            return {name: s for name, s in out.items() if name != "weight"} | self.int4_shares
        scale = self.quant.scale_shard(out["weight"]) if self.quant is not None else None
        if scale is not None:  # None: the scale is whole on every rank
            out[self.quant.scale_name] = scale
        return out


class ColumnParallelLinear(QuantizableLinear):
    """`out_rows` picks this rank's output features (default: an even split)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE, out_rows=None):
        super().__init__()
        self.start, self.stop = out_rows or split(out_features, tp)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, in_features))
        self.bias = nn.Parameter(torch.empty(self.stop - self.start)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def shards(self) -> dict[str, Shard]:
        out = {"weight": Shard(0, self.start, self.stop, (self.out_features, self.in_features))}
        if self.bias is not None:
            out["bias"] = Shard(0, self.start, self.stop, (self.out_features,))
        return self.quant_shards(out)


class RowParallelLinear(QuantizableLinear):
    """`reduce=False` leaves the partial sum to the caller (an MoE layer all-reduces once for all its
    experts); such a layer has no bias, which would be added once per rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE, reduce=True):
        super().__init__()
        assert reduce or not bias, "a RowParallelLinear that does not reduce has no bias"
        self.tp, self.reduce = tp, reduce
        self.start, self.stop = split(in_features, tp)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.stop - self.start))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.tp.enabled and self.reduce):
            return self.matmul(x, self.bias)
        return self.reduced(self.matmul(x, None))

    def reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' partial products (each of its input features) summed, plus the bias."""
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def shards(self) -> dict[str, Shard]:
        return self.quant_shards({"weight": Shard(1, self.start, self.stop, (self.out_features, self.in_features))})


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp, self.vocab, self.dim = tp, vocab, dim
        self.start, self.stop = split(padded_vocab(vocab, tp.size), tp)
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.stop)
        out = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        return self.tp.all_reduce(out * mine[:, None].to(out.dtype))

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.start, self.stop, (self.vocab, self.dim))}


class ParallelLMHead(nn.Module):
    """Shares the embedding's weight when `tied` (the same rows of the same vocabulary)."""

    def __init__(self, vocab: int, dim: int, tp: TensorParallel = SINGLE, tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp, self.vocab, self.dim = tp, vocab, dim
        self.start, self.stop = split(padded_vocab(vocab, tp.size), tp)
        self.weight = tied.weight if tied is not None else nn.Parameter(torch.empty(self.stop - self.start, dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(linear(hidden, self.weight))
        return logits[..., : self.vocab] if self.tp.enabled else logits

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.start, self.stop, (self.vocab, self.dim))}


def fuse_columns(parts: list[ColumnParallelLinear], filled: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding `parts`' output rows one after another; each part's parameters
    become views of its rows, so the loader fills them by their checkpoint names as before and one
    matmul computes all of them (vLLM's and SGLang's fused qkv_proj and gate_up_proj, made at load).
    `filled=False`: the parts hold no values yet (the loader fuses before it fills), so none are copied."""
    first = parts[0].weight
    weight = torch.empty(sum(p.weight.shape[0] for p in parts), first.shape[1], dtype=first.dtype, device=first.device)
    biased = all(p.bias is not None for p in parts)
    bias = torch.empty(weight.shape[0], dtype=first.dtype, device=first.device) if biased else None
    row = 0
    for p in parts:
        rows = slice(row, row + p.weight.shape[0])
        if filled:
            weight[rows] = p.weight
        p.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            if filled:
                bias[rows] = p.bias
            p.bias = nn.Parameter(bias[rows], requires_grad=False)
        row = rows.stop
    return weight, bias


def param_shards(model: nn.Module) -> dict[str, Shard]:
    """Every sharded parameter of `model` by its full name; the others are whole on every rank."""
    out: dict[str, Shard] = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "shards"):
            out.update({f"{prefix}.{name}" if prefix else name: s for name, s in module.shards().items()})
    return out
