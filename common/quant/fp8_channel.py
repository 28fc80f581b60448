"""compressed-tensors' FP8 weights (llm-compressor's `float-quantized` format) behind the parallel linear
layers: the weight stays float8_e4m3fn and `weight_scale` holds one float32 per output row (per-channel,
[rows, 1]) or one for the whole tensor (per-tensor), w = q * weight_scale.

The product upcasts the weight into a buffer shared by every layer of its shape (as fp8_block), which
is exactly the weight transformers' compressed-tensors loader dequantizes to. Activation quantization,
static (`input_scale`) or dynamic, is the FP8 GEMM's business: on the CPU the activations stay in the
model's dtype (weight-only), which the start-up summary says.

TP: a column-parallel rank's per-channel scale is its rows' share; a row-parallel rank keeps every row
(its columns are split, not its rows); a per-tensor scale is whole everywhere. No split can cut a scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.parallel.layers import Shard, linear
from common.quant.fp8_block import fp8_pair, in_dtype, upcast
from common.wire.user_error import UserError

SCALE_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class ChannelFP8:
    """One layer's method: `per_channel` (else per-tensor); `column`: its rows are split over the ranks."""

    per_channel: bool
    column: bool
    scale_name = "weight_scale"

    def scale_shard(self, weight: Shard) -> Shard | None:
        if not (self.per_channel and self.column):
            return None  # whole on every rank
        return Shard(0, weight.start, min(weight.stop, weight.full_shape[0]), (weight.full_shape[0], 1))

    def local_scale_shape(self, rows: int, full_rows: int) -> tuple[int, ...]:
        if not self.per_channel:
            return (1,)
        return (rows if self.column else full_rows, 1)

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, reuse=True) -> torch.Tensor:
        return in_dtype(upcast(weight).mul_(scale.float().view(-1, 1)), dtype, reuse)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        return linear(x, self.dequantize(weight, scale, x.dtype), bias)


def check_channel_pair(prefix: str, header: dict[str, dict], per_channel: bool) -> bool:
    """Whether `prefix`'s weight is FP8 with a weight_scale of the strategy's shape (False: unquantized)."""
    pair = fp8_pair(prefix, header, ".weight_scale")
    if pair is None:
        return False
    weight, scale = pair
    rows = weight["shape"][0]
    shape = list(scale["shape"])
    fits = shape in ([rows, 1], [rows]) if per_channel else shape in ([1], [], [1, 1])
    if not fits or scale["dtype"] not in SCALE_DTYPES:
        want = f"[{rows}, 1] (per-channel)" if per_channel else "[1] (per-tensor)"
        raise UserError(f"{prefix}.weight_scale: shape {shape} {scale['dtype']}, but the scheme needs float32 {want}")
    return True
