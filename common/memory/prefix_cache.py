"""The prefix-cache seam: `PrefixCache`, and `NoPrefixCache`, which caches nothing (--disable-radix-cache). Which
cache a server runs is common/memory/prefix_cache_factory.py's choice."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from common.memory.allocator import PagedAllocator


@dataclass
class MatchResult:
    slots: torch.Tensor  # KV slots of the matched prefix; length is a multiple of page_size
    last_node: Any  # lock this while the slots are in use


class PrefixCache(ABC):
    @abstractmethod
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of token_ids."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect the path to node from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one inc_lock_ref."""

    @abstractmethod
    def cache_finished_req(self, token_ids: list[int], slots: torch.Tensor, last_node: Any) -> None:
        """Take over a finished request's KV: keep what is worth caching, free the rest, unlock."""

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to num_pages unlocked cached pages, least recently used first; returns pages freed."""

    @abstractmethod
    def evictable_pages(self) -> int:
        """Cached pages no request locks."""

    @abstractmethod
    def locked_pages(self) -> int:
        """Cached pages some request locks."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise MemoryIntegrityError if the bookkeeping is inconsistent."""

    # a cache with work in flight (the store tier) overrides these; the others have none
    def prefetch(self, owner: Any, token_ids: list[int]) -> None:
        """A request (`owner`) is queued for prefill: start bringing what it could reuse closer."""

    def ready(self, owner: Any) -> bool:
        """Whether `owner` may be admitted now (its prefetch is done, or the policy lets it go)."""
        return True

    def poll(self) -> None:
        """Once per scheduler step: take in the work finished since the last call."""

    def close(self) -> None:
        """Stop the cache's threads (server shutdown)."""


class NoPrefixCache(PrefixCache):
    """Caches nothing: a finished request's pages go straight back to the allocator."""

    def __init__(self, allocator: PagedAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64), None)

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def cache_finished_req(self, token_ids: list[int], slots: torch.Tensor, last_node: Any) -> None:
        self.allocator.free_slots(slots)

    def evict(self, num_pages: int) -> int:
        return 0

    def evictable_pages(self) -> int:
        return 0

    def locked_pages(self) -> int:
        return 0

    def check_integrity(self) -> None:
        pass
