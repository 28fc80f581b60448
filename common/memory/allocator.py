"""Page allocator: free page ids 1..num_pages (0 is the padding page). Frees are batched and merged
into the sorted free list lazily, so allocations take the lowest ids and runs stay contiguous."""
from __future__ import annotations

from typing import Iterable

import torch

from common.memory.errors import MemoryIntegrityError


class PagedAllocator:
    def __init__(self, num_pages: int, page_size: int, device: str = "cpu"):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages, self.page_size, self.device = num_pages, page_size, device
        self._free: list[int] = list(range(num_pages, 0, -1))  # sorted descending: pop() is the lowest
        self._released: list[int] = []
        self._is_free = bytearray([1]) * (num_pages + 1)
        self._is_free[0] = 0

    def available_pages(self) -> int:
        return len(self._free) + len(self._released)

    def can_alloc(self, n_pages: int) -> bool:
        return n_pages <= self.available_pages()

    def alloc(self, n_pages: int) -> list[int]:
        if n_pages > self.available_pages():
            raise RuntimeError(f"need {n_pages} pages, {self.available_pages()} free; ask can_alloc() first")
        if n_pages > len(self._free):
            self._merge()
        pages = self._free[len(self._free) - n_pages :][::-1]
        del self._free[len(self._free) - n_pages :]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def _merge(self) -> None:
        self._free = sorted(self._free + self._released, reverse=True)
        self._released = []

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if not 1 <= p <= self.num_pages:
                raise ValueError(f"page {p} is out of range [1, {self.num_pages}]")
            if self._is_free[p]:
                raise ValueError(f"page {p} is already free (double free)")
            self._is_free[p] = 1
            self._released.append(p)

    # -- token-level helpers -------------------------------------------------------------------
    def pages_needed(self, prefix_len: int, seq_len: int) -> int:
        """New pages to hold tokens [prefix_len, seq_len) when [0, prefix_len) already fill pages."""
        ps = self.page_size
        return -(-seq_len // ps) - -(-prefix_len // ps)

    def alloc_token_slots(self, prefix_len: int, seq_len: int, last_loc: int) -> torch.Tensor:
        """KV slots for tokens [prefix_len, seq_len): the rest of last_loc's page, then new pages."""
        ps = self.page_size
        in_page = (-prefix_len) % ps if prefix_len > 0 else 0  # free slots left in the last page
        head = min(in_page, seq_len - prefix_len)
        slots = list(range(last_loc + 1, last_loc + 1 + head))
        pages = self.alloc(self.pages_needed(prefix_len, seq_len))
        slots += [p * ps + o for p in pages for o in range(ps)][: seq_len - prefix_len - head]
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def pages_of(self, slots: torch.Tensor) -> list[int]:
        return torch.unique(slots.to(torch.int64) // self.page_size).tolist()

    def free_slots(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.free(self.pages_of(slots))

    def check_integrity(self) -> None:
        pool = self._free + self._released
        if len(set(pool)) != len(pool):
            raise MemoryIntegrityError("page free list has duplicates")
        if any(not 1 <= p <= self.num_pages for p in pool):
            raise MemoryIntegrityError("page free list holds an out-of-range page")
        if sum(self._is_free) != len(pool):
            raise MemoryIntegrityError(f"free flags ({sum(self._is_free)}) disagree with the free list ({len(pool)})")
