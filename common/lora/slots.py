"""The adapters' device slots: --max-loras-per-batch of them, each one adapter's A and B for every target module
of every layer (A [rank, in], B transposed [rank, out]), zero-padded to --max-lora-rank (a padded rank adds nothing to the product). An adapter is copied
in from host memory when a request needs it and no slot holds it, into the least recently used slot no running
request pins and no pinned adapter (--lora-paths' `pinned`) holds; a request waits while every slot is taken by
others. Unloading an adapter (/unload_lora_adapter) empties its slot once no request pins it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from common.lora.adapter import LoraAdapter


@dataclass(frozen=True)
class LoraShard:
    """This rank's part of a module's A and B, split as its base layer is (tensor parallelism): a column-parallel
    layer's output rows (`rows`: B's rows [start, stop), A whole), a row-parallel one's input features (A's
    columns, B whole: each rank's partial delta joins its partial product before the layer's all-reduce)."""

    rows: bool
    start: int
    stop: int

    def of(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (a, b[self.start : self.stop]) if self.rows else (a[:, self.start : self.stop], b)


class LoraSlots:
    def __init__(
        self,
        count: int,
        max_rank: int,
        shapes: dict[str, tuple[int, int]],
        layers: int,
        device: str,
        dtype: torch.dtype,
        shards: dict[str, LoraShard] | None = None,
    ):
        """`shapes`: per target module, the base layer's (out, in) features; `shards`: this rank's part of each
        (tensor parallelism; None: whole)."""
        self.shards = shards or {}
        local = {m: self._local(m, out, inp) for m, (out, inp) in shapes.items()}
        keys = [(layer, m) for layer in range(layers) for m in shapes]
        self.a = {k: torch.zeros(count, max_rank, local[k[1]][1], device=device, dtype=dtype) for k in keys}
        # B is kept transposed, [rank, out] per slot: every slot's B is then one [slots * rank, out] matrix
        self.b = {k: torch.zeros(count, max_rank, local[k[1]][0], device=device, dtype=dtype) for k in keys}
        self.scaling = [0.0] * count
        self.a_dtype, self.device = dtype, device
        self.held: list[str | None] = [None] * count  # the adapter each slot holds
        self.pins = [0] * count  # running requests using each slot
        self.used = [0] * count  # when each was last pinned (LRU)
        self.loads = 0  # adapters copied in, ever
        self.kept: set[str] = set()  # pinned adapters: never evicted
        self._clock = itertools.count(1)

    def _local(self, module: str, out: int, inp: int) -> tuple[int, int]:
        shard = self.shards.get(module)
        if shard is None:
            return out, inp
        width = shard.stop - shard.start
        return (width, inp) if shard.rows else (out, width)

    def can_pin(self, name: str) -> bool:
        return name in self.held or bool(self._free())

    def _free(self) -> list[int]:
        return [i for i, p in enumerate(self.pins) if p == 0 and self.held[i] not in self.kept]

    def pin(self, adapter: LoraAdapter) -> int:
        """The slot holding `adapter` (copied in if none did), pinned once more; needs can_pin."""
        if adapter.name in self.held:
            slot = self.held.index(adapter.name)
        else:
            slot = min(self._free(), key=lambda i: self.used[i])
            self.load(slot, adapter)
        self.pins[slot] += 1
        self.used[slot] = next(self._clock)
        return slot

    def unpin(self, slot: int) -> None:
        self.pins[slot] -= 1

    def keep(self, adapter: LoraAdapter) -> None:
        """Hold `adapter` in a slot for good (a pinned adapter); needs a free slot besides one for the others."""
        self.pin(adapter)
        self.unpin(self.held.index(adapter.name))
        self.kept.add(adapter.name)

    def evict(self, name: str) -> None:
        """Empty the slot holding `name`, if one does (no request pins it: the adapter was unloaded)."""
        self.kept.discard(name)
        if name in self.held:
            slot = self.held.index(name)
            self.held[slot], self.used[slot] = None, 0

    def report(self) -> list[dict]:
        """Per slot: the adapter it holds and the requests pinning it (/get_server_info)."""
        return [{"adapter": h, "pins": p, "pinned": h in self.kept} for h, p in zip(self.held, self.pins)]

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` (this rank's part of it) into `slot`, whatever it held (a follower rank: as rank 0 did)."""
        r = adapter.rank
        for key, a in self.a.items():
            a[slot].zero_()
            self.b[key][slot].zero_()
            weights = adapter.weights.get(key)
            if weights is not None:
                shard = self.shards.get(key[1])
                wa, wb = shard.of(*weights) if shard is not None else weights
                a[slot, :r].copy_(wa)
                self.b[key][slot, :r].copy_(wb.T)
        self.scaling[slot] = adapter.scaling
        self.held[slot] = adapter.name
        self.loads += 1
