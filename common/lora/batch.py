"""One forward's LoRA: which rows run under which slot, and the segmented product the model's projections add.

A request's new tokens are consecutive rows of the batch, so the rows of one adapter are a few segments; each
adds `x A^T B^T * scaling` of its slot to the base projection's output. Rows of requests without an adapter
are in no segment: untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.lora.slots import LoraSlots


@dataclass(frozen=True)
class LoraBatch:
    segments: list[tuple[int, int, int]]  # (first row, end row, slot), neighbours of one slot merged
    slots: LoraSlots

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
        for start, end, slot in self.batch.segments:
            y[start:end] += (x[start:end] @ a[slot].T) @ b[slot].T * slots.scaling[slot]
        return y


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
