"""Request-slot table: row per running request, value = KV slot index of each token position."""
from __future__ import annotations

import torch

from common.memory.errors import MemoryIntegrityError


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str):
        if size < 1 or max_context_len < 1:
            raise ValueError(f"size ({size}) and max_context_len ({max_context_len}) must be positive")
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=device)
        self._free = list(range(size - 1, -1, -1))
        self._is_free = bytearray([1]) * size

    def available_size(self) -> int:
        return len(self._free)

    def can_alloc(self) -> bool:
        return bool(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("no free request slot; ask can_alloc() first")
        row = self._free.pop()
        self._is_free[row] = 0
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise ValueError(f"request slot {row} is out of range [0, {self.size})")
        if self._is_free[row]:
            raise ValueError(f"request slot {row} is already free")
        self._is_free[row] = 1
        self._free.append(row)

    def check_integrity(self) -> None:
        if len(set(self._free)) != len(self._free):
            raise MemoryIntegrityError("request slot free list has duplicates")
        if sum(self._is_free) != len(self._free) or any(not self._is_free[r] for r in self._free):
            raise MemoryIntegrityError("request slot free list disagrees with the free flags")
