"""The prefix-cache seam: RadixCache, or NoPrefixCache when --disable-radix-cache is set."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from common.memory.allocator import PagedAllocator


@dataclass(frozen=True)
class MatchResult:
    slots: torch.Tensor  # int64 KV slots of the matched prefix; length is a multiple of page_size
    last_node: Any  # the node to inc_lock_ref while the slots are in use


class PrefixCache(ABC):
    @abstractmethod
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of token_ids. Does not lock it."""

    @abstractmethod
    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        """Take over the page-aligned head of slots; returns how many leading tokens were cached
        already (the tree keeps its own pages for those; the caller's copies stay the caller's)."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect the path root..node from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one inc_lock_ref(node)."""

    @abstractmethod
    def cache_finished_req(self, token_ids: list[int], slots: torch.Tensor, last_node: Any) -> None:
        """Take over a finished request's KV: keep what is worth caching, free the rest, unlock."""

    @abstractmethod
    def cache_unfinished_req(self, token_ids: list[int], slots: torch.Tensor, last_node: Any) -> tuple[torch.Tensor, Any]:
        """Cache a running request's aligned head after a prefill chunk; returns (head slots the
        cache now holds for it, the node it now has locked). The tail stays the caller's."""

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to num_pages unlocked cached pages, least recently used first; returns pages freed
        (may exceed num_pages by part of a node)."""

    @abstractmethod
    def evictable_pages(self) -> int:
        """Cached pages no request locks."""

    @abstractmethod
    def locked_pages(self) -> int:
        """Cached pages some request locks."""

    def total_pages(self) -> int:
        """Every page the cache holds."""
        return self.evictable_pages() + self.locked_pages()

    @abstractmethod
    def reset(self) -> None:
        """Return every cached page to the allocator; refuses while any page is locked."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise MemoryIntegrityError if the bookkeeping is inconsistent."""


class NoPrefixCache(PrefixCache):
    """Caches nothing: every page stays the request's, and goes back to the allocator when it ends."""

    def __init__(self, allocator: PagedAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        return MatchResult(self._empty(), None)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        return 0  # stores nothing: the caller keeps (and frees) every page

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def cache_finished_req(self, token_ids: list[int], slots: torch.Tensor, last_node: Any) -> None:
        self.allocator.free_slots(slots)

    def cache_unfinished_req(self, token_ids: list[int], slots: torch.Tensor, last_node: Any) -> tuple[torch.Tensor, Any]:
        return self._empty(), None

    def evict(self, num_pages: int) -> int:
        return 0

    def evictable_pages(self) -> int:
        return 0

    def locked_pages(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def check_integrity(self) -> None:
        pass
