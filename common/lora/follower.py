"""A follower rank's LoRA (tensor parallelism): the adapters of --lora-paths read as rank 0 read them, its part
of each slot (common/lora/setup.py), and each step's LoRA rebuilt from rank 0's wire: first the adapter each slot
holds (by number: its place in --lora-paths; 0 none), copied in where this rank's slot holds another, then the
segments. Rank 0 decides which adapter goes where (its LRU); a follower only follows."""

from __future__ import annotations

from torch import nn

from common.lora.batch import LoraBatch, make_lora_batch
from common.lora.setup import LoraSetup


class FollowerLora:
    def __init__(self, setup: LoraSetup, model: nn.Module):
        self.slots = setup.slots(model)
        self.by_number = {i + 1: a for i, a in enumerate(setup.adapters)}

    def batch(self, wire: list[int]) -> LoraBatch:
        count = len(self.slots.held)
        for slot, number in enumerate(wire[:count]):
            adapter = self.by_number.get(number)
            if adapter is not None and self.slots.held[slot] != adapter.name:
                self.slots.load(slot, adapter)
        rest = wire[count:]
        segments = [(rest[i], rest[i + 1], rest[i + 2]) for i in range(0, len(rest), 3)]
        return make_lora_batch(segments, self.slots, self.slots.device)
