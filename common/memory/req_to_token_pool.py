"""Request-slot table: one row per running request, value = KV slot index of each token position.

One more row, `padding_row`, is never handed out and stays all 0 (slot 0 of page 0, the pool's padding
page): the rows a CUDA graph's batch is padded with point there (common.engine.cuda_graph)."""

from __future__ import annotations

import torch

from common.memory.errors import MemoryIntegrityError


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if max_context_len < 1:
            raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(size + 1, max_context_len, dtype=torch.int32, device=device)
        self.padding_row = size
        self._free = list(range(size - 1, -1, -1))  # pop() hands out the lowest row first
        self._is_free = bytearray([1]) * size

    def available_size(self) -> int:
        return len(self._free)

    def can_alloc(self) -> bool:
        return bool(self._free)

    def alloc(self) -> int:
        """A free row. Ask can_alloc() first."""
        if not self._free:
            raise RuntimeError("no free request slot; ask can_alloc() first")
        row = self._free.pop()
        self._is_free[row] = 0
        return row

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.size:
            raise ValueError(f"request slot {slot} is out of range [0, {self.size})")
        if self._is_free[slot]:
            raise ValueError(f"request slot {slot} is already free (double free)")
        self._is_free[slot] = 1
        self._free.append(slot)

    def check_integrity(self) -> None:
        if any(not 0 <= r < self.size for r in self._free):
            raise MemoryIntegrityError("request slot free list holds an out-of-range row")
        if len(set(self._free)) != len(self._free):
            raise MemoryIntegrityError("request slot free list has duplicates")
        if sum(self._is_free) != len(self._free) or not all(self._is_free[r] for r in self._free):
            raise MemoryIntegrityError("request slot free list disagrees with the free flags")
