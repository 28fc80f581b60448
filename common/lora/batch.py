"""One forward's LoRA: which rows run under which slot, and the segmented product the model's projections add.

A request's new tokens are consecutive rows of the batch, so the rows of one adapter are a few segments; each
adds `x A^T B^T * scaling` of its slot to the base projection's output. Rows of requests without an adapter
are in no segment: untouched. A batch of a few rows over several segments (a decode step) runs every slot at
once instead (`Masked`): `x` times all slots' A side by side ([slots * rank, in]: the pool's layout, no copy),
each row's product kept only over its own slot's rank columns (the mask, which holds its scaling; zero
elsewhere, so the other slots add exact zeros), times all slots' B stacked: two matrix products per module, no
gather of any weight, whatever the adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.lora.slots import LoraSlots

if TYPE_CHECKING:
    from common.parallel.layers import RowParallelLinear

MASKED_MAX_ROWS = 64  # at most this many rows with an adapter: every slot at once under a mask, else per segment


@dataclass(frozen=True)
class Masked:
    """The rows that have an adapter and, per row, its scaling over its slot's rank columns (a decode step's)."""

    rows: torch.Tensor  # [R] int64, ascending
    mask: torch.Tensor  # [R, slots * rank]


@dataclass(frozen=True)
class LoraBatch:
    segments: list[tuple[int, int, int]]  # (first row, end row, slot), neighbours of one slot merged
    slots: LoraSlots
    masked: Masked | None = None  # set when there are several segments of few rows (make_lora_batch)
    wire: list[int] | None = None  # what the follower ranks get of it (tensor parallelism: common/ranks/step.py)

    def layer(self, layer_id: int) -> LayerLora:
        return LayerLora(self, layer_id)


@dataclass(frozen=True)
class LayerLora:
    """The batch's LoRA at one decoder layer, as its projections call it."""

    batch: LoraBatch
    layer_id: int

    def add(self, y: torch.Tensor, x: torch.Tensor, module: str) -> torch.Tensor:
        """`y` (the base projection of `x`, or a view of its part of a fused weight) plus each segment's delta,
        in place; a module no adapter targets leaves it as it is."""
        slots, key = self.batch.slots, (self.layer_id, module)
        a = slots.a.get(key)
        if a is None:
            return y
        b = slots.b[key]
        m = self.batch.masked
        if m is not None:
            every = m.rows.numel() == x.shape[0]  # ascending distinct rows: all of them, in order
            low = torch.mm(x if every else x[m.rows], a.view(-1, a.shape[-1]).T).mul_(m.mask)
            if every and y.dtype == low.dtype:
                return y.addmm_(low, b.view(-1, b.shape[-1]))
            delta = torch.mm(low, b.view(-1, b.shape[-1])).to(y.dtype)
            return y.add_(delta) if every else y.index_add_(0, m.rows, delta)
        for start, end, slot in self.batch.segments:
            part = y[start:end]
            part.addmm_(torch.mm(x[start:end], a[slot].T), b[slot], alpha=slots.scaling[slot])
        return y

    def row_parallel(self, proj: RowParallelLinear, x: torch.Tensor, module: str) -> torch.Tensor:
        """A row-parallel projection of `x` (this rank's input features) plus the delta: each rank adds its
        partial `x A[:, mine]^T B^T` to its partial product, and the layer's one all-reduce sums both."""
        if not (proj.tp.enabled and proj.reduce):
            return self.add(proj(x), x, module)
        return proj.reduced(self.add(proj.matmul(x, None), x, module))


def make_lora_batch(
    segments: list[tuple[int, int, int]], slots: LoraSlots, device: str, wire: list[int] | None = None
) -> LoraBatch:
    """The batch's LoRA, every slot at once under a mask when it has several segments of at most MASKED_MAX_ROWS
    rows in all."""
    rows = sum(end - start for start, end, _ in segments)
    if len(segments) < 2 or rows > MASKED_MAX_ROWS:
        return LoraBatch(segments, slots, wire=wire)
    rank = next(iter(slots.a.values())).shape[1] if slots.a else 0
    mask = torch.zeros(rows, len(slots.held) * rank, dtype=slots.a_dtype)
    index, i = [], 0
    for start, end, slot in segments:
        mask[i : i + end - start, slot * rank : (slot + 1) * rank] = slots.scaling[slot]
        index += range(start, end)
        i += end - start
    masked = Masked(torch.tensor(index, dtype=torch.int64).to(device), mask.to(device))
    return LoraBatch(segments, slots, masked, wire)


def segments_of(row_slots: list[int | None], lens: list[int]) -> list[tuple[int, int, int]]:
    """Per request its slot (None: no adapter) and its new tokens -> the batch's segments."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for slot, n in zip(row_slots, lens):
        if slot is not None and n:
            if out and out[-1][2] == slot and out[-1][1] == start:
                out[-1] = (out[-1][0], start + n, slot)
            else:
                out.append((start, start + n, slot))
        start += n
    return out
