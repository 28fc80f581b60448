"""The adapters' device slots: --max-loras-per-batch of them, each one adapter's A and B for every target module
of every layer, zero-padded to --max-lora-rank (a padded rank adds nothing to the product). An adapter is copied
in from host memory when a request needs it and no slot holds it, into the least recently used slot no running
request pins; a request waits while every slot is pinned by others."""

from __future__ import annotations

import itertools

import torch

from common.lora.adapter import LoraAdapter


class LoraSlots:
    def __init__(
        self,
        count: int,
        max_rank: int,
        shapes: dict[str, tuple[int, int]],
        layers: int,
        device: str,
        dtype: torch.dtype,
    ):
        """`shapes`: per target module, the base layer's (out, in) features."""
        keys = [(layer, m) for layer in range(layers) for m in shapes]
        self.a = {k: torch.zeros(count, max_rank, shapes[k[1]][1], device=device, dtype=dtype) for k in keys}
        self.b = {k: torch.zeros(count, shapes[k[1]][0], max_rank, device=device, dtype=dtype) for k in keys}
        self.scaling = [0.0] * count
        self.a_dtype, self.device = dtype, device
        self.held: list[str | None] = [None] * count  # the adapter each slot holds
        self.pins = [0] * count  # running requests using each slot
        self.used = [0] * count  # when each was last pinned (LRU)
        self.loads = 0  # adapters copied in, ever
        self._clock = itertools.count(1)

    def can_pin(self, name: str) -> bool:
        return name in self.held or 0 in self.pins

    def pin(self, adapter: LoraAdapter) -> int:
        """The slot holding `adapter` (copied in if none did), pinned once more; needs can_pin."""
        if adapter.name in self.held:
            slot = self.held.index(adapter.name)
        else:
            slot = min((i for i, p in enumerate(self.pins) if p == 0), key=lambda i: self.used[i])
            self._load(slot, adapter)
        self.pins[slot] += 1
        self.used[slot] = next(self._clock)
        return slot

    def unpin(self, slot: int) -> None:
        self.pins[slot] -= 1

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        r = adapter.rank
        for key, a in self.a.items():
            a[slot].zero_()
            self.b[key][slot].zero_()
            weights = adapter.weights.get(key)
            if weights is not None:
                a[slot, :r].copy_(weights[0])
                self.b[key][slot, :, :r].copy_(weights[1])
        self.scaling[slot] = adapter.scaling
        self.held[slot] = adapter.name
        self.loads += 1
