"""DeepSeek's FP8 block weights behind the parallel linear layers: the weight stays float8_e4m3fn on the
device and `weight_scale_inv` holds one float32 per (rows x columns) block, w = q * scale_inv.

On CUDA, a layer in DeepSeek's 128x128 blocks runs torch's block-scaled FP8 GEMM (common.quant.fp8_gemm)
where a probe finds it. On the CPU (and wherever that GEMM does not apply) `forward` upcasts one weight at a time into a buffer reused
by every layer of that shape and multiplies in the activations' dtype: exactly the weight transformers'
FineGrainedFP8 dequantizes to, and at most one full-precision weight per shape alive at once.

A TP rank holds rows (column-parallel) or columns (row-parallel) [start, stop) of the weight; its scale
rows or columns are the blocks those cover, [start // block, ceil(stop / block)). A rank whose share starts
inside a block keeps that block's scale too (`offset`), so any split is exact: blocks shared by two ranks
are scaled alike on both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.parallel.layers import Shard, linear
from common.quant import fp8_gemm
from common.wire.user_error import UserError

FP8 = torch.float8_e4m3fn
_buffers: dict[tuple, torch.Tensor] = {}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockFP8:
    """One layer's method: `block` (rows, columns); `offset` (rows, columns) of this rank's first weight
    element inside its first block."""

    block: tuple[int, int]
    offset: tuple[int, int] = (0, 0)
    scale_name = "weight_scale_inv"

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """The scale of a weight [rows, cols] whose first element sits at `offset` in its block."""
        return ceil_div(self.offset[0] + rows, self.block[0]), ceil_div(self.offset[1] + cols, self.block[1])

    def scale_shard(self, weight: Shard) -> Shard:
        """The scale rows or columns covering the weight's `weight` shard."""
        b, full = self.block[weight.dim], weight.full_shape
        stop = min(weight.stop, full[weight.dim])
        scale_full = (ceil_div(full[0], self.block[0]), ceil_div(full[1], self.block[1]))
        return Shard(weight.dim, weight.start // b, ceil_div(stop, b), scale_full)

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, reuse=True) -> torch.Tensor:
        """The weight in `dtype`, in the buffer its shape shares (`reuse`) or a fresh tensor."""
        rows, cols = weight.shape
        work = upcast(weight)
        (bn, bk), (r0, c0) = self.block, self.offset
        by_row = scale.float().repeat_interleave(bn, 0)[r0 : r0 + rows]  # [rows, column blocks]
        if c0 == 0 and cols % bk == 0:
            work.view(rows, cols // bk, bk).mul_(by_row[:, :, None])
        else:
            work.mul_(by_row.repeat_interleave(bk, 1)[:, c0 : c0 + cols])
        return in_dtype(work, dtype, reuse)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        if fp8_gemm.fits(x, weight, self.block, self.offset):
            return fp8_gemm.block_scaled_mm(x, weight, scale, bias)
        return linear(x, self.dequantize(weight, scale, x.dtype), bias)


def upcast(weight: torch.Tensor) -> torch.Tensor:
    """The FP8 weight in float32, in the buffer its shape shares: the scales multiply in float32 (exactly
    transformers' rounding; a float32 tensor times float32 scales is also 10x faster than a bfloat16 one
    times float32 scales on the CPU, docs/performance.md)."""
    return _buffer(weight.shape, torch.float32, weight.device).copy_(weight)


def in_dtype(work: torch.Tensor, dtype: torch.dtype, reuse: bool) -> torch.Tensor:
    """The dequantized float32 `work` in `dtype`: itself, its shape's `dtype` buffer, or a fresh tensor."""
    if dtype == torch.float32 and reuse:
        return work
    out = _buffer(work.shape, dtype, work.device) if reuse else torch.empty_like(work, dtype=dtype)
    return out.copy_(work)


def reserve_buffers(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Allocate now the dequantization buffers the model's FP8 layers will use (every layer the GEMM does not
    take), so a KV pool sized from the memory left after loading never counts on memory a first forward
    would take; their bytes. Called on CUDA only: the CPU has no pool sized from free memory."""
    before = sum(b.nbytes for b in _buffers.values())
    for module in model.modules():
        quant, weight = getattr(module, "quant", None), getattr(module, "weight", None)
        if quant is None or weight is None or weight.dtype != FP8 or _gemm_takes(quant, weight):
            continue
        upcast(weight)
        if dtype != torch.float32:
            _buffer(weight.shape, dtype, weight.device)
    return sum(b.nbytes for b in _buffers.values()) - before


def _gemm_takes(quant, weight: torch.Tensor) -> bool:
    """Whether every product of this layer runs the block-scaled GEMM (fp8_gemm.fits for any 2-D input)."""
    if not isinstance(quant, BlockFP8) or not weight.is_cuda:
        return False
    probe = torch.empty(1, weight.shape[1], device=weight.device)
    return fp8_gemm.fits(probe, weight, quant.block, quant.offset)


def _buffer(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (tuple(shape), dtype, device)
    if key not in _buffers:
        _buffers[key] = torch.empty(shape, dtype=dtype, device=device)
    return _buffers[key]


FP8_NAME = "F8_E4M3"  # safetensors' name of float8_e4m3fn


def fp8_pair(prefix: str, header: dict[str, dict], scale_name: str) -> tuple[dict, dict] | None:
    """`prefix`'s weight and scale header entries when its weight is FP8 (None: unquantized); refuses a
    weight without its scale and a scale without an FP8 weight. The scale's shape is the scheme's to check."""
    weight, scale = header[prefix + ".weight"], header.get(prefix + scale_name)
    if weight["dtype"] != FP8_NAME and scale is None:
        return None
    if scale is None:
        raise UserError(f"{prefix}.weight is float8 but {prefix}{scale_name} is missing; an FP8 weight needs its scale")
    if weight["dtype"] != FP8_NAME:
        raise UserError(f"{prefix}{scale_name}: its weight is {weight['dtype']}, not float8 (F8_E4M3)")
    return weight, scale
