"""GGUF's block formats unpacked into one form: integer `codes` [rows, columns], float32 `scales` and
`mins` [rows, columns / group] with

    w = (codes - zero) * scales + mins          (in float32, as the `gguf` package's dequantizers compute)

    Q4_0  blocks of 32: f16 d, 16 bytes of nibbles           codes 0..15, zero 8, scales d, no mins
    Q4_1  blocks of 32: f16 d, f16 m, nibbles                codes 0..15, zero 0, scales d, mins m
    Q4_K  super-blocks of 256: f16 d, f16 dmin, 12 bytes of  codes 0..15, zero 0, groups of 32:
          6-bit sub-scales and sub-mins, nibbles             scales d * sc, mins -(dmin * m)
    Q8_0  blocks of 32: f16 d, 32 int8                       codes -128..127, zero 0, scales d
    Q6_K  super-blocks of 256: 4+2-bit codes, 16 int8 sub-   codes -32..31, zero 0, groups of 16:
          scales, f16 d                                      scales d * sc

The three 4-bit types go to torch's CPU int4 kernel (common.quant.int4_cpu) as they are; Q8_0, Q6_K and the
float types (F32, F16, BF16) are dequantized once at load (`dense`). Anything else is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

INT4 = {T.Q4_0: "Q4_0", T.Q4_1: "Q4_1", T.Q4_K: "Q4_K"}
INT8 = {T.Q8_0: "Q8_0", T.Q6_K: "Q6_K"}
FLOAT = {T.F32: "F32", T.F16: "F16", T.BF16: "BF16"}
READ = "Q4_0, Q4_1 and Q4_K (kept in 4 bits), Q8_0, Q6_K, F16, BF16 and F32 (dequantized at load)"  # what loads


@dataclass(frozen=True)
class Groups:
    """One tensor's codes and per-group float32 scales and mins (None: zero), `group` columns each."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    zero: int
    group: int

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, computed as the `gguf` package computes it."""
        rows, columns = self.codes.shape
        w = (self.codes.float() - self.zero).view(rows, -1, self.group) * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.view(rows, columns)

    def int4(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """codes, scales and offsets in common.quant.int4_cpu's form: w = (codes - 8) * scales + offsets."""
        offsets = (8 - self.zero) * self.scales
        return self.codes, self.scales, offsets if self.mins is None else offsets + self.mins

    def rows(self, index: torch.Tensor | slice) -> Groups:
        mins = None if self.mins is None else self.mins[index]
        return Groups(self.codes[index], self.scales[index], mins, self.zero, self.group)

    def columns(self, start: int, stop: int) -> Groups:
        g = self.group
        mins = None if self.mins is None else self.mins[:, start // g : stop // g]
        return Groups(self.codes[:, start:stop], self.scales[:, start // g : stop // g], mins, self.zero, g)


def type_name(kind: T) -> str:
    return {**INT4, **INT8, **FLOAT}.get(kind, kind.name)


def unpack(raw: np.ndarray, kind: T, columns: int) -> Groups:
    """`raw` [rows, bytes per row] of a Q4_0/Q4_1/Q4_K/Q8_0/Q6_K tensor of `columns` columns, unpacked."""
    rows = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw)).view(rows, -1, BLOCK_BYTES[kind])
    return UNPACK[kind](blocks, rows, columns)


def dense(raw: np.ndarray, kind: T, columns: int) -> torch.Tensor:
    """The float32 tensor of any read type (exactly the `gguf` package's)."""
    if kind in FLOAT:
        data = torch.from_numpy(np.array(raw))
        return data.view(torch.bfloat16).float() if kind == T.BF16 else data.float()
    return unpack(raw, kind, columns).dequantize()


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per f16, [..., 2] -> float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes: the low nibbles first, then the high ones (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_0(blocks: torch.Tensor, rows: int, columns: int) -> Groups:
    codes = _nibbles(blocks[..., 2:]).reshape(rows, columns)
    return Groups(codes, _f16(blocks[..., :2]), None, 8, 32)


def _q4_1(blocks: torch.Tensor, rows: int, columns: int) -> Groups:
    codes = _nibbles(blocks[..., 4:]).reshape(rows, columns)
    return Groups(codes, _f16(blocks[..., :2]), _f16(blocks[..., 2:4]), 0, 32)


def _q4_k(blocks: torch.Tensor, rows: int, columns: int) -> Groups:
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = _k_scale_min(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # 4 pairs of sub-blocks: low nibbles, then high
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(rows, columns)
    scales = (d[..., None] * sc.float()).reshape(rows, -1)
    mins = -(dmin[..., None] * m.float()).reshape(rows, -1)
    return Groups(codes, scales, mins, 0, 32)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> 8 six-bit sub-block scales and 8 mins (ggml's get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q8_0(blocks: torch.Tensor, rows: int, columns: int) -> Groups:
    codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, columns)
    return Groups(codes, _f16(blocks[..., :2]), None, 0, 32)


def _q6_k(blocks: torch.Tensor, rows: int, columns: int) -> Groups:
    ql, qh = blocks[..., :128].reshape(rows, -1, 2, 1, 64), blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(rows, -1, 2, 4, 32)
    high = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=3)
    codes = ((low | (high << 4)).to(torch.int8) - 32).reshape(rows, columns)
    sub = blocks[..., 192:208].contiguous().view(torch.int8).float()
    scales = (_f16(blocks[..., 208:210])[..., None] * sub).reshape(rows, -1)
    return Groups(codes, scales, None, 0, 16)


BLOCK_BYTES = {T.Q4_0: 18, T.Q4_1: 20, T.Q4_K: 144, T.Q8_0: 34, T.Q6_K: 210}
UNPACK = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k, T.Q8_0: _q8_0, T.Q6_K: _q6_k}
