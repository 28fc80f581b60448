"""Where each 4-bit format keeps a linear layer's weight [N outputs, K inputs] on disk, and its unpacking
into common.quant.int4_cpu's codes, scales and zero points (w = (codes - zeros) * scales, both [N, K / g]).
Eight 4-bit values share one int32, the first in its lowest bits.

    awq            qweight [K, N/8] (outputs packed in AutoAWQ's order 0 2 4 6 1 3 5 7), qzeros [K/g, N/8],
                   scales [K/g, N]
    gptq, gptq_v2  qweight [K/8, N] (inputs packed in order), qzeros [K/g, N/8] (v1: z - 1 stored),
                   scales [K/g, N], g_idx [K] (each input's group; desc_act: not in order)
    pack-quantized weight_packed [N, K/8], weight_scale [N, K/g], weight_zero_point [N/8, K/g] (asymmetric
                   only; compressed-tensors stores both as signed values + 8), weight_shape [2]

A `Spec` says which dimension of a tensor its outputs and inputs index, and how many of them one entry
covers (8 packed, g a group, 0 for a dimension kept whole): a TP rank's share is a slice of it, and a share
that does not start and stop on an entry's boundary cuts a group or an int32 and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.quant.int4_scheme import Int4Format

AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # output column j of eight sits in nibble AWQ_REVERSE[j]
INT32 = ("I32",)
FLOATS = ("F16", "BF16", "F32")


@dataclass(frozen=True)
class Spec:
    """One checkpoint tensor of a quantized layer: its full shape, dtypes, and (dim, entries' width) of its
    output and input dimensions (dim None: not indexed by them; width 0: kept whole on every rank)."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    out_dim: tuple[int | None, int]
    in_dim: tuple[int | None, int]
    required: bool = True


def specs(fmt: Int4Format, out: int, inp: int) -> dict[str, Spec]:
    """The layer's tensors by suffix, for a weight [out, inp]."""
    g = inp if fmt.group == -1 else fmt.group
    groups_width = 0 if fmt.group == -1 else g  # one group per row: every rank keeps it whole
    if fmt.layout == "awq":
        made = {
            "qweight": Spec((inp, out // 8), INT32, (1, 8), (0, 1)),
            "qzeros": Spec((inp // g, out // 8), INT32, (1, 8), (0, groups_width), fmt.zero_points),
            "scales": Spec((inp // g, out), FLOATS, (1, 1), (0, groups_width)),
        }
        return made if fmt.zero_points else {n: s for n, s in made.items() if n != "qzeros"}
    if fmt.layout in ("gptq", "gptq_v2"):
        width = 0 if fmt.act_order else groups_width  # act-order: any input may need any group
        return {
            "qweight": Spec((inp // 8, out), INT32, (1, 1), (0, 8)),
            "qzeros": Spec((inp // g, out // 8), INT32, (1, 8), (0, width)),
            "scales": Spec((inp // g, out), FLOATS, (1, 1), (0, width)),
            "g_idx": Spec((inp,), INT32, (None, 0), (0, 1), fmt.act_order),
        }
    made = {
        "weight_packed": Spec((out, inp // 8), INT32, (0, 1), (1, 8)),
        "weight_scale": Spec((out, inp // g), FLOATS, (0, 1), (1, groups_width)),
        "weight_zero_point": Spec((out // 8, inp // g), INT32, (0, 8), (1, groups_width)),
        "weight_shape": Spec((2,), ("I64", "I32"), (None, 0), (None, 0)),
    }
    return made if fmt.zero_points else {n: s for n, s in made.items() if n != "weight_zero_point"}


def packed_name(fmt: Int4Format) -> str:
    """The suffix whose presence makes a layer quantized."""
    return "weight_packed" if fmt.layout == "pack-quantized" else "qweight"


def nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The eight 4-bit values of each int32, along `dim` (0 or 1) in bit order, as uint8 (read through the
    int32s' little-endian bytes: the low nibble of byte i is value 2i)."""
    rows, cols = packed.shape
    by = packed.contiguous().view(torch.uint8)  # [R, 4C]
    values = torch.stack([by & 15, by >> 4], dim=-1).view(rows, cols, 8)
    if dim == 1:
        return values.reshape(rows, cols * 8)
    return values.permute(0, 2, 1).reshape(rows * 8, cols)


def awq_columns(values: torch.Tensor) -> torch.Tensor:
    """Undo AutoAWQ's order of the eight outputs in each int32."""
    order = torch.arange(values.shape[1]).view(-1, 8)[:, list(AWQ_REVERSE)].reshape(-1)
    return values[:, order]


def unpack(
    fmt: Int4Format, t: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] uint8, scales [N, K/g] float32, zeros [N, K/g] float32, g_idx [K] or an empty tensor)
    from one rank's share of a layer's tensors `t` (by suffix)."""
    none = torch.empty(0, dtype=torch.int64)
    if fmt.layout == "awq":
        codes, scales = awq_columns(nibbles(t["qweight"], 1)).t(), t["scales"].float().t()
        zeros = awq_columns(nibbles(t["qzeros"], 1)).t().float() if fmt.zero_points else torch.full_like(scales, 8)
        return codes, scales, zeros, none
    if fmt.layout in ("gptq", "gptq_v2"):
        codes, scales = nibbles(t["qweight"], 0).t(), t["scales"].float().t()
        zeros = nibbles(t["qzeros"], 1).t().float() + (1 if fmt.layout == "gptq" else 0)
        return codes, scales, zeros, t["g_idx"].long() if "g_idx" in t else none
    scales = t["weight_scale"].float()
    zeros = nibbles(t["weight_zero_point"], 0).float() if fmt.zero_points else torch.full_like(scales, 8)
    return nibbles(t["weight_packed"], 1), scales, zeros, none
