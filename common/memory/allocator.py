"""Page allocator over KV pages 1..num_pages (page 0 is the padding page and never handed out).

Page p holds token slots [p * page_size, (p + 1) * page_size). Frees are appended to a release
list and merged into the sorted free list only when an allocation needs them (SGLang's
merge_and_sort_free), so allocations take the lowest ids and runs of pages stay contiguous.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from common.core.page_meta import pages_for
from common.memory.errors import MemoryIntegrityError


class PagedAllocator:
    def __init__(self, num_pages: int, page_size: int, device: str = "cpu"):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages, self.page_size, self.device = num_pages, page_size, device
        self._free: list[int] = list(range(num_pages, 0, -1))  # sorted descending: the tail is the lowest
        self._released: list[int] = []
        self._is_free = bytearray([1]) * (num_pages + 1)  # O(1) double-free detection
        self._is_free[0] = 0

    # -- pages ---------------------------------------------------------------------------------
    def available_pages(self) -> int:
        return len(self._free) + len(self._released)

    def can_alloc(self, n_pages: int) -> bool:
        return 0 <= n_pages <= self.available_pages()

    def is_free(self, page: int) -> bool:
        if not 0 <= page <= self.num_pages:
            raise ValueError(f"page {page} is out of range [0, {self.num_pages}]")
        return bool(self._is_free[page])

    def alloc(self, n_pages: int) -> list[int]:
        """The n_pages lowest free page ids, ascending. Ask can_alloc() first."""
        if n_pages < 0:
            raise ValueError(f"n_pages must be >= 0, got {n_pages}")
        if n_pages > self.available_pages():
            raise RuntimeError(f"need {n_pages} pages, {self.available_pages()} free; ask can_alloc() first")
        if n_pages > len(self._free):
            self._merge_and_sort_free()
        cut = len(self._free) - n_pages
        pages = self._free[cut:][::-1]
        del self._free[cut:]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def _merge_and_sort_free(self) -> None:
        self._free = sorted(self._free + self._released, reverse=True)
        self._released = []

    def free(self, pages: Iterable[int]) -> None:
        """Return pages. Validates all of them first, so a bad call frees nothing."""
        pages = [int(p) for p in pages]
        for p in pages:
            if not 1 <= p <= self.num_pages:
                raise ValueError(f"page {p} is out of range [1, {self.num_pages}]")
            if self._is_free[p]:
                raise ValueError(f"page {p} is already free (double free)")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages {pages} name a page twice (double free)")
        for p in pages:
            self._is_free[p] = 1
        self._released.extend(pages)

    # -- token-level helpers -------------------------------------------------------------------
    def pages_needed(self, prefix_len: int, seq_len: int) -> int:
        """New pages to hold tokens [prefix_len, seq_len) when [0, prefix_len) already fill pages,
        the last one possibly partially."""
        if not 0 <= prefix_len <= seq_len:
            raise ValueError(f"need 0 <= prefix_len ({prefix_len}) <= seq_len ({seq_len})")
        return pages_for(seq_len, self.page_size) - pages_for(prefix_len, self.page_size)

    def alloc_token_slots(self, prefix_len: int, seq_len: int, last_loc: int) -> torch.Tensor:
        """KV slots (int64) for tokens [prefix_len, seq_len): first the rest of the page holding
        last_loc (the slot of token prefix_len - 1, or -1 when prefix_len == 0), then new pages."""
        ps = self.page_size
        free_in_page = (-prefix_len) % ps  # free slots left in the last page
        if free_in_page and (last_loc < ps or last_loc % ps != (prefix_len - 1) % ps):
            raise ValueError(f"last_loc {last_loc} cannot hold token {prefix_len - 1} with page_size {ps}")
        head = min(free_in_page, seq_len - prefix_len)
        pages = self.alloc(self.pages_needed(prefix_len, seq_len))
        in_page = torch.arange(last_loc + 1, last_loc + 1 + head, dtype=torch.int64)
        new = (torch.tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).flatten()
        slots = torch.cat([in_page, new[: seq_len - prefix_len - head]])
        return slots.to(self.device)

    def pages_of(self, slots: torch.Tensor) -> list[int]:
        """Distinct page ids holding these slots, ascending."""
        return torch.unique(slots.to(torch.int64) // self.page_size).tolist()

    def free_slots(self, slots: torch.Tensor) -> None:
        """free(pages_of(slots)): only for callers that own every page these slots touch."""
        if slots.numel():
            self.free(self.pages_of(slots))

    def check_integrity(self) -> None:
        pool = self._free + self._released
        if len(set(pool)) != len(pool):
            raise MemoryIntegrityError("page free list has duplicates")
        if any(not 1 <= p <= self.num_pages for p in pool):
            raise MemoryIntegrityError("page free list holds an out-of-range page")
        if sum(self._is_free) != len(pool) or not all(self._is_free[p] for p in pool):
            raise MemoryIntegrityError(f"free flags ({sum(self._is_free)}) disagree with the free list ({len(pool)})")
