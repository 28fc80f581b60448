"""A 4-bit weight-only layer behind the parallel linear layers (AWQ, GPTQ, compressed-tensors pack-quantized).

The loader fills the checkpoint's own tensors (common.quant.int4_layouts: `qweight`, `scales`, ...), this
rank's share of each; `finish` then unpacks them once into codes, scales and offsets and packs those for
torch's CPU int4 kernel (common.quant.int4_cpu): the layer keeps `weight` (the kernel's packed codes) and
`weight_groups` (its scales and offsets), and the checkpoint's tensors are dropped. A layer whose shape the
kernel does not take (or on another device) keeps its codes as uint8 and float32 (scale, offset) pairs and
multiplies by its dequantized weight instead.

GPTQ's act-order (`desc_act`, a `g_idx` not in order): the weight's input columns are sorted by their group
at load, so each group is contiguous as the kernel needs, and every product gathers the activations'
columns in that order (`perm`): x[:, perm] @ w[:, perm]^T = x @ w^T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from common.parallel.layers import linear
from common.quant.int4_cpu import Int4Weight, dequantize, fits
from common.quant.int4_layouts import unpack
from common.quant.int4_scheme import Int4Format
from common.wire.user_error import UserError


@dataclass
class Int4Linear:
    """One layer's method: `group` (this rank's inputs per scale), `first_group`: the global index of this
    rank's first group (g_idx counts from the whole layer's), `raw`: the checkpoint tensors' suffixes."""

    fmt: Int4Format
    group: int
    first_group: int
    raw: tuple[str, ...]
    prefix: str
    kernel: Int4Weight | None = None
    perm: torch.Tensor | None = None
    scale_name = "weight_groups"

    @torch.no_grad()
    def finish(self, module: nn.Module) -> None:
        """Replace the filled checkpoint tensors of `module` by the product's `weight` and `weight_groups`."""
        codes, scales, zeros, g_idx = unpack(self.fmt, {n: getattr(module, n).cpu() for n in self.raw})
        device = next(getattr(module, n) for n in self.raw).device
        for name in self.raw:
            delattr(module, name)
        codes = self.in_group_order(codes, g_idx)
        offsets = (8 - zeros) * scales
        rows, columns = codes.shape
        if device.type == "cpu" and fits(rows, columns, self.group):
            self.kernel = Int4Weight.pack(codes, scales, offsets, self.group)
            weight, groups = self.kernel.packed, self.kernel.scales_and_offsets
        else:
            weight, groups = codes.contiguous(), torch.stack([scales, offsets], dim=-1)
        module.weight = nn.Parameter(weight.to(device), requires_grad=False)
        module.weight_groups = nn.Parameter(groups.to(device), requires_grad=False)
        self.perm = None if self.perm is None else self.perm.to(device)

    def in_group_order(self, codes: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
        """`codes` with its columns sorted by group (GPTQ's g_idx; `perm` set when that moves any)."""
        if g_idx.numel() == 0:
            return codes
        local = g_idx - self.first_group
        order = torch.argsort(local, stable=True)
        if not torch.equal(local[order], torch.arange(len(local)) // self.group):
            raise UserError(
                f"{self.prefix}.g_idx: its inputs do not fall into whole groups of {self.group} on this rank; "
                "serve this checkpoint at --tp-size 1"
            )
        if torch.equal(order, torch.arange(len(order))):
            return codes
        self.perm = order
        return codes[:, order]

    def apply(self, x: torch.Tensor, weight: torch.Tensor, groups: torch.Tensor, bias: torch.Tensor | None):
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.kernel is not None:
            y = self.kernel.product(x)
        else:
            y = linear(x, self.in_order_dequantized(weight, groups, x.dtype), None)
        return y if bias is None else y + bias

    def in_order_dequantized(self, weight: torch.Tensor, groups: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` with its columns in group order (what `apply` multiplies the gathered x by)."""
        if self.kernel is not None:  # the kernel's own reading: its product with the identity
            eye = torch.eye(self.kernel.columns, dtype=dtype, device=weight.device)
            return self.kernel.product(eye).t().contiguous()
        return dequantize(weight, groups[..., 0], groups[..., 1], self.group).to(dtype)

    def dequantize(self, weight: torch.Tensor, groups: torch.Tensor, dtype: torch.dtype, reuse=True) -> torch.Tensor:
        """The weight in `dtype`, its columns in the checkpoint's order (MLA's absorbed products read it)."""
        ordered = self.in_order_dequantized(weight, groups, dtype)
        if self.perm is None:
            return ordered
        out = torch.empty_like(ordered)
        out[:, self.perm] = ordered
        return out
