"""Registered host memory holding one aux record per in-flight transfer; prefill writes a slot remotely."""

from __future__ import annotations

import torch

from transfer.aux_record import record_bytes


class AuxPool:
    def __init__(
        self, num_slots: int, buffer: torch.Tensor | None = None, first: int = 0, slot_bytes: int = record_bytes()
    ):
        """`buffer`, `first`: slots [first, first + num_slots) of another pool's buffer (`shares`); `slot_bytes`:
        one record's size (NEXTN's and EAGLE's carry a hidden state)."""
        self.num_slots, self.first = num_slots, first
        self.buffer = buffer if buffer is not None else torch.zeros(num_slots, slot_bytes, dtype=torch.uint8)
        self._free = list(range(first + num_slots - 1, first - 1, -1))

    def shares(self, n: int) -> list[AuxPool]:
        """`n` pools of disjoint slots of this buffer (one per DP rank's role; the registered memory is one)."""
        per = self.num_slots // n
        return [AuxPool(per, self.buffer, i * per) for i in range(n)]

    @property
    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def can_alloc(self) -> bool:
        return bool(self._free)

    def alloc(self) -> int:
        slot = self._free.pop()
        self.buffer[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if not self.first <= slot < self.first + self.num_slots or slot in self._free:
            raise ValueError(f"aux slot {slot} is out of range or already free")
        self._free.append(slot)

    def read(self, slot: int) -> bytes:
        return self.buffer[slot].numpy().tobytes()

    def check_integrity(self, in_use: int) -> None:
        if len(set(self._free)) != len(self._free) or len(self._free) + in_use != self.num_slots:
            raise RuntimeError(f"aux pool leak: {len(self._free)} free + {in_use} in use != {self.num_slots}")
