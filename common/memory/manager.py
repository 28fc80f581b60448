"""Request rows, KV pages and the prefix cache behind one small interface for the scheduler.

A request's KV slots, by token index (req_to_token[row, i]), and who frees them:

    [0, cached_len)                 radix-tree pages, locked by req.last_node  -> release(): unlocked
    [cached_len, computed)          pages the request owns, KV written         -> release(): whole pages into
                                    (computed = req.kv_computed_len)              the tree (duplicates freed)
    [computed rounded down to a page, kv_len)
                                    pages the request owns, KV partial or not  -> release(): freed; never
                                    written (a failed forward, a transfer that     cached, so the cache only
                                    never arrived, a partial tail page)            holds KV that was computed
    row itself                      ReqToTokenPool row                         -> release(): freed

release() is the only way out, and every exit of a request ends in exactly one call (the scheduler's
finish, or a role's deferred release once no peer can write into the pages).

Invariant (check_integrity): free + evictable + locked + owned_by_requests == total pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.core.page_meta import pages_for
from common.core.request import Req
from common.memory.allocator import PagedAllocator
from common.memory.errors import MemoryIntegrityError
from common.memory.prefix_cache import PrefixCache
from common.memory.req_to_token_pool import ReqToTokenPool


@dataclass(frozen=True)
class PageCounts:
    total: int
    free: int
    evictable: int
    locked: int
    owned: int

    def to_dict(self) -> dict[str, int]:
        return {
            "total": self.total,
            "free": self.free,
            "cached": self.evictable,
            "locked": self.locked,
            "in_use": self.owned,
        }


class MemoryManager:
    def __init__(
        self,
        req_pool: ReqToTokenPool,
        allocator: PagedAllocator,
        prefix_cache: PrefixCache,
        page_size: int,
        reuse_cut: bool = False,
    ):
        """`reuse_cut`: a prefix hit gives up its last page (NEXTN, EAGLE, EAGLE3: the head's KV at a page's last slot
        depends on the token after it, which the hit does not check: common/engine/spec/head_drafter.py)."""
        self.reuse_cut = reuse_cut
        self.req_pool = req_pool
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.page_size = page_size
        self.live: dict[int, Req] = {}  # row -> request holding it

    # -- admission ---------------------------------------------------------------------------
    def can_admit(self) -> bool:
        return self.req_pool.can_alloc()

    def admit(self, req: Req, match_limit: int) -> None:
        """Give `req` a row and reuse the longest cached prefix of its first `match_limit` tokens."""
        row = self.req_pool.alloc()
        self.live[row] = req
        req.req_pool_idx = row
        match = self.prefix_cache.match_prefix(req.cache_key[: max(match_limit, 0)])
        if self.reuse_cut and len(match.slots):
            match = self.prefix_cache.match_prefix(req.cache_key[: len(match.slots) - self.page_size])
        self.prefix_cache.inc_lock_ref(match.last_node)
        n = len(match.slots)
        self.req_pool.req_to_token[row, :n] = match.slots.to(torch.int32)
        req.last_node, req.cached_len, req.kv_len, req.kv_computed_len = match.last_node, n, n, n

    def mark_computed(self, req: Req) -> None:
        """The KV of all `req.kv_len` tokens is now written (a forward ran, or a transfer arrived)."""
        req.kv_computed_len = req.kv_len

    def page_ids(self, req: Req, start: int, end: int) -> list[int]:
        """Ids of the pages holding tokens [start, end) of `req`; `start` must be page-aligned."""
        if start % self.page_size:
            raise ValueError(f"start {start} is not a multiple of the page size {self.page_size}")
        slots = self.req_pool.req_to_token[req.req_pool_idx, start : end : self.page_size]
        return (slots.to(torch.int64) // self.page_size).tolist()

    def available_pages(self) -> int:
        """Pages an allocation can get: free now, or cached and evictable."""
        return self.allocator.available_pages() + self.prefix_cache.evictable_pages()

    def can_extend(self, req: Req, num_tokens: int) -> bool:
        return self.allocator.pages_needed(req.kv_len, req.kv_len + num_tokens) <= self.available_pages()

    def extend(self, req: Req, num_tokens: int) -> torch.Tensor:
        """Allocate KV slots for the next `num_tokens` tokens of `req`; returns them (int64)."""
        start, end = req.kv_len, req.kv_len + num_tokens
        self._evict_for(self.allocator.pages_needed(start, end))
        row = req.req_pool_idx
        last_loc = int(self.req_pool.req_to_token[row, start - 1]) if start > 0 else -1
        slots = self.allocator.alloc_token_slots(start, end, last_loc)
        self.req_pool.req_to_token[row, start:end] = slots.to(torch.int32)
        req.kv_len = end
        return slots

    def alloc_decode_pages(self, reqs: list[Req]) -> list[int]:
        """One more token for every request of a decode batch, on the host: a page for each whose last
        page is full, allocated at once; every `kv_len` grows by one. Returns, per request, the first slot
        of its new page, or -1 (the token goes to the slot after its last one: write_decode_slots)."""
        ps = self.page_size
        new_page = [r.kv_len % ps == 0 for r in reqs]
        self._evict_for(sum(new_page))
        pages = iter(self.allocator.alloc(sum(new_page)))
        first = [next(pages) * ps if new else -1 for new in new_page]
        for req in reqs:
            req.kv_len += 1
        return first

    def undo_decode_pages(self, reqs: list[Req], first_slots: list[int]) -> None:
        """alloc_decode_pages undone (its slots could not be written): lengths back, new pages freed."""
        for req in reqs:
            req.kv_len -= 1
        self.allocator.free(slot // self.page_size for slot in first_slots if slot >= 0)

    def write_decode_slots(
        self, rows: torch.Tensor, positions: torch.Tensor, first_slots: torch.Tensor
    ) -> torch.Tensor:
        """The decode tokens' slots into req_to_token, on the device: `positions` (the tokens' indices) and
        `first_slots` (alloc_decode_pages's) are on it. Returns the slots (int64)."""
        table = self.req_pool.req_to_token
        after_last = table[rows, positions - 1].long() + 1  # a decoding request has KV, so positions >= 1
        slots = torch.where(first_slots >= 0, first_slots, after_last)
        table[rows, positions] = slots.to(torch.int32)
        return slots

    def truncate(self, req: Req, kv_len: int) -> None:
        """Drop the slots of tokens [kv_len, req.kv_len) (a verify's rejected drafts: their KV is never
        cached): the pages wholly past `kv_len` are freed, the one it ends in is kept (its tail is
        written again by the next step)."""
        if not max(req.cached_len, req.kv_computed_len) <= kv_len <= req.kv_len:
            raise ValueError(f"truncate to {kv_len}: outside [computed {req.kv_computed_len}, kv_len {req.kv_len}]")
        first_freed = pages_for(kv_len, self.page_size) * self.page_size
        if first_freed < req.kv_len:
            slots = self.req_pool.req_to_token[req.req_pool_idx, first_freed : req.kv_len]
            self.allocator.free_slots(slots.to(torch.int64))
        req.kv_len = kv_len

    def _evict_for(self, pages: int) -> None:
        short = pages - self.allocator.available_pages()
        if short > 0:
            self.prefix_cache.evict(short)
        if self.allocator.available_pages() < pages:
            raise RuntimeError(f"KV cache exhausted: need {pages} pages, {self.allocator.available_pages()} free")

    def hand_over(self, req: Req, to: Req) -> None:
        """Everything `req` holds (row, pages, locked prefix) now held by `to`, `req` holding nothing: a decode
        whose room failed keeps the pages a late write may land in quarantined while the request goes on."""
        row = req.req_pool_idx
        to.req_pool_idx, to.last_node, to.kv_len, to.cached_len, to.kv_computed_len = (
            row,
            req.last_node,
            req.kv_len,
            req.cached_len,
            req.kv_computed_len,
        )
        if row is not None:
            self.live[row] = to
        req.req_pool_idx, req.last_node, req.kv_len, req.cached_len, req.kv_computed_len = None, None, 0, 0, 0

    # -- release -----------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Return everything `req` holds; whole pages of computed KV stay in the prefix cache."""
        row = req.req_pool_idx
        if row is None:
            return
        slots = self.req_pool.req_to_token[row, : req.kv_len].to(torch.int64)
        keep = max(req.kv_computed_len // self.page_size * self.page_size, req.cached_len)
        self.prefix_cache.cache_finished_req(req.cache_key[:keep], slots[:keep], req.last_node)
        self.allocator.free_slots(slots[keep:])
        self.req_pool.free(row)
        del self.live[row]
        req.req_pool_idx, req.last_node, req.kv_len, req.cached_len, req.kv_computed_len = None, None, 0, 0, 0

    # -- accounting --------------------------------------------------------------------------
    def owned_pages(self, req: Req) -> int:
        return self.allocator.pages_needed(req.cached_len, req.kv_len) if req.kv_len > req.cached_len else 0

    def page_counts(self) -> PageCounts:
        return PageCounts(
            total=self.allocator.num_pages,
            free=self.allocator.available_pages(),
            evictable=self.prefix_cache.evictable_pages(),
            locked=self.prefix_cache.locked_pages(),
            owned=sum(self.owned_pages(r) for r in self.live.values()),
        )

    def check_integrity(self) -> PageCounts:
        self.req_pool.check_integrity()
        self.allocator.check_integrity()
        self.prefix_cache.check_integrity()
        c = self.page_counts()
        if c.free + c.evictable + c.locked + c.owned != c.total:
            raise MemoryIntegrityError(
                f"page leak: free {c.free} + cached {c.evictable} + locked {c.locked} + in_use {c.owned} != total {c.total}"
            )
        if self.req_pool.available_size() + len(self.live) != self.req_pool.size:
            raise MemoryIntegrityError("request rows leaked")
        return c
