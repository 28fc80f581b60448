"""The CPU product of group-wise 4-bit weights, shared by every 4-bit format (GGUF Q4_0/Q4_1/Q4_K, AWQ,
GPTQ, compressed-tensors pack-quantized): each format unpacks its tensors into `codes` (one integer 0..15
per weight, [rows, columns]) and per-group `scales` and `offsets` ([rows, columns / group]) such that

    w[r, c] = (codes[r, c] - 8) * scales[r, c // group] + offsets[r, c // group]

(a format with a zero point z: offsets = (8 - z) * scales; one with a minimum m: offsets = m + 8 * scales),
and `Int4Weight.pack` turns them into torch's own CPU kernel's layout (`_weight_int4pack_mm_for_cpu`,
torchao's "tinygemm" convention, which the formula above is).

The kernel reads a quarter of float32's bytes and is about 3x faster than float32 `F.linear` at batch 1
with bfloat16 activations on this 2-core machine, but about 10x slower than it with float32 activations,
so `product` runs it in bfloat16 (and returns the caller's dtype). Its shapes: rows a multiple of 16,
columns a multiple of the group, group 32, 64, 128 or 256; `fits` says whether a layer qualifies, and a
layer that does not is dequantized at its product instead (`dequantize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUPS = (32, 64, 128, 256)
COMPUTE = torch.bfloat16


def fits(rows: int, columns: int, group: int) -> bool:
    """Whether torch's CPU int4 kernel takes a [rows, columns] weight of this group size."""
    return group in GROUPS and rows % 16 == 0 and columns % group == 0


@dataclass(frozen=True)
class Int4Weight:
    """One layer's packed weight: `packed` in the kernel's layout, `scales_and_offsets` [columns / group,
    rows, 2] in COMPUTE, and the unpacked `codes` kept only when the kernel does not fit the shape."""

    packed: torch.Tensor
    scales_and_offsets: torch.Tensor
    group: int
    rows: int
    columns: int

    @staticmethod
    def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int) -> Int4Weight:
        rows, columns = codes.shape
        if not fits(rows, columns, group):
            raise ValueError(f"a [{rows}, {columns}] weight in groups of {group} does not fit the int4 kernel")
        if scales.shape != (rows, columns // group) or offsets.shape != scales.shape:
            raise ValueError(f"scales {tuple(scales.shape)} and offsets {tuple(offsets.shape)} for {rows}x{columns}")
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        pairs = torch.stack([scales.t(), offsets.t()], dim=-1).to(COMPUTE).contiguous()
        return Int4Weight(packed, pairs, group, rows, columns)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., columns] @ w.T in COMPUTE, returned in x's dtype."""
        flat = x.reshape(-1, self.columns).to(COMPUTE)
        out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_offsets)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.rows)

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_offsets.nbytes


def dequantize(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 weight the formula above gives (the reference, and the path for shapes the kernel refuses)."""
    expand = lambda t: t.float().repeat_interleave(group, dim=1)  # noqa: E731
    return (codes.float() - 8) * expand(scales) + expand(offsets)
