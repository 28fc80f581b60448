"""One forward's LoRA: which rows run under which slot, and the segmented product the model's projections add.

A request's new tokens are consecutive rows of the batch, so the rows of one adapter are a few segments; each
adds `x A^T B^T * scaling` of its slot to the base projection's output. Rows of requests without an adapter
are in no segment: untouched. A batch of a few rows over several segments (a decode step) gathers each row's
A and B instead and adds every delta in two batched products (`gathered`): one call per module, not per
segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.lora.slots import LoraSlots

if TYPE_CHECKING:
    from common.parallel.layers import RowParallelLinear

GATHER_MAX_ROWS = 64  # at most this many rows with an adapter: gathered per row, else per segment


@dataclass(frozen=True)
class Gathered:
    """The rows that have an adapter, their slots and scalings (a decode step's LoRA)."""

    rows: torch.Tensor  # [R] int64
    slots: torch.Tensor  # [R] int64
    scaling: torch.Tensor  # [R, 1]


@dataclass(frozen=True)
class LoraBatch:
    segments: list[tuple[int, int, int]]  # (first row, end row, slot), neighbours of one slot merged
    slots: LoraSlots
    gathered: Gathered | None = None  # set when there are several segments of few rows (make_lora_batch)
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
        g = self.batch.gathered
        if g is not None:
            low = torch.bmm(x[g.rows].unsqueeze(1), a[g.slots].transpose(1, 2))  # [R, 1, rank]
            delta = torch.bmm(low, b[g.slots].transpose(1, 2)).squeeze(1) * g.scaling
            return y.index_add_(0, g.rows, delta.to(y.dtype))
        for start, end, slot in self.batch.segments:
            y[start:end] += (x[start:end] @ a[slot].T) @ b[slot].T * slots.scaling[slot]
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
    """The batch's LoRA, gathered per row when it has several segments of at most GATHER_MAX_ROWS rows in all."""
    rows = sum(end - start for start, end, _ in segments)
    if len(segments) < 2 or rows > GATHER_MAX_ROWS:
        return LoraBatch(segments, slots, wire=wire)
    per_row = [(r, slot) for start, end, slot in segments for r in range(start, end)]
    index = torch.tensor(per_row, dtype=torch.int64)
    scaling = torch.tensor([[slots.scaling[s]] for _, s in per_row], dtype=slots.a_dtype)
    gathered = Gathered(index[:, 0].to(device), index[:, 1].to(device), scaling.to(device))
    return LoraBatch(segments, slots, gathered, wire)


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
