"""The host tier of the prefix cache (`--enable-hierarchical-cache`, SGLang's HiCache): the device radix
cache in front of a second radix tree whose nodes own pages of the host tier's pool (common.memory.host_pool).

    device tree   pages of the device pool; what requests lock and read
    host tree     pages of the host pool; never read by a forward, only copied back

- A leaf the device tree evicts is copied to the host tree first (`on_evict`), unless the host holds
  those tokens already. With `--hicache-write-policy write_through` a request's KV is also copied when
  it enters the device tree (so an eviction later copies nothing); `write_back` copies only on eviction.
- `match_prefix` matches both trees; when the host tree matches further, the extra pages are loaded
  into newly allocated device pages (evicting device leaves if needed) and inserted into the device tree
  before the match is returned: the forward that needs them runs after the copy (host_pool's ordering).
- `_backed_up` hears of every run of pages copied to the host (the KV store tier behind this one writes them
  out: common/memory/store/store_cache.py).
- Who frees what: the device tree frees device pages (as RadixCache); the host tree frees host pages
  when it evicts its own LRU leaves to make room for a copy. Both paths of a copy are locked while it
  is made, so neither tier evicts what is being copied.
- Copies out do not hold the compute stream (host_pool.py): a write-through copy keeps its device node
  locked until the copy's event has passed (`writing`, released by `_release_written` whenever the
  cache is used: the pages cannot be evicted and reused meanwhile, as SGLang's write-through); a copy
  made because its node is being evicted is waited for on the host before the node's pages are freed (as
  SGLang's write-back). Loads hold the compute stream: the next forward reads those pages.

    pages                          locked by                    released / freed by
    device node being written      `writing` (write-through)    _release_written, once its event passed
    device node being evicted      -                            RadixCache.evict, after the copy is waited for
"""

from __future__ import annotations

import os
from typing import Any

import torch

from common.memory.allocator import PagedAllocator
from common.memory.cache_listener import HOST_MEDIUM, CacheListener
from common.memory.errors import MemoryIntegrityError
from common.memory.host_pool import HostPool
from common.memory.prefix_cache import MatchResult, PrefixCache
from common.memory.radix_cache import RadixCache, TreeNode
from common.wire.user_error import UserError

WRITE_POLICIES = ("write_through", "write_back")


def page_slots(pages: list[int], page_size: int) -> torch.Tensor:
    """Every token slot of these pages, in order (int64)."""
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).flatten()


def joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return b if not a.numel() else torch.cat([a, b.to(a.device)])


def path_of(node: TreeNode) -> tuple[list[int], torch.Tensor]:
    """The tokens and slots from the root down to node (inclusive)."""
    nodes = node.path()
    return [t for n in nodes for t in n.key], torch.cat([n.value for n in nodes])


class HiRadixCache(PrefixCache):
    def __init__(
        self,
        allocator: PagedAllocator,
        pool: HostPool,
        write_policy: str = "write_through",
        listener: CacheListener | None = None,
    ):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        self.allocator, self.pool, self.page_size = allocator, pool, allocator.page_size
        self.write_policy = write_policy
        self.device = RadixCache(allocator, self.page_size, listener)
        self.host = RadixCache(pool.allocator, self.page_size, listener, HOST_MEDIUM)
        self.device.on_evict = self._on_device_evict
        self.host_hit_tokens = 0  # tokens matched in the host tier and loaded back
        self.writing: list[tuple[Any, TreeNode]] = []  # (copy's event, device node it locks), oldest first

    # -- lookup ----------------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        self._release_written()
        dev = self.device.match_prefix(token_ids)
        host = self.host.match_prefix(token_ids)
        if len(host.slots) <= len(dev.slots) or not self._load(token_ids, dev, host):
            return dev
        return self.device.match_prefix(token_ids)

    def _load(self, token_ids: list[int], dev: MatchResult, host: MatchResult) -> int:
        """Copy the host-only pages of the match into new device pages; returns how many."""
        ps, have = self.page_size, len(dev.slots)
        want = (len(host.slots) - have) // ps
        self.device.inc_lock_ref(dev.last_node)
        self.host.inc_lock_ref(host.last_node)
        try:
            short = want - self.allocator.available_pages()
            if short > 0:
                self.device.evict(short)
            pages = self.allocator.alloc(min(want, self.allocator.available_pages()))
            if pages:
                end = have + len(pages) * ps
                self.pool.load((host.slots[have:end:ps] // ps).tolist(), pages)
                slots = page_slots(pages, ps).to(self.allocator.device)
                self.device.insert(token_ids[:end], joined(dev.slots, slots))
        finally:
            self.host.dec_lock_ref(host.last_node)
            self.device.dec_lock_ref(dev.last_node)
        self.host_hit_tokens += len(pages) * ps
        return len(pages)

    # -- copies to the host ----------------------------------------------------------------------
    def _on_device_evict(self, node: TreeNode) -> None:
        done = self._backup(*path_of(node))
        if done is not None:  # the node's pages are freed on return: the copy must have read them
            done.synchronize()

    def _release_written(self) -> None:
        """Unlock the device nodes whose write-through copies have landed (in order: events pass in order)."""
        while self.writing and self.writing[0][0].query():
            self.device.dec_lock_ref(self.writing.pop(0)[1])

    def _backup(self, tokens: list[int], slots: torch.Tensor):
        """Make the host tree hold `tokens` (page-aligned), copying the pages it lacks from `slots`;
        returns the copy's event (None: nothing copied, or done already)."""
        ps = self.page_size
        match = self.host.match_prefix(tokens)
        have = len(match.slots)
        want = (len(tokens) - have) // ps
        if want <= 0:
            return None
        self.host.inc_lock_ref(match.last_node)
        try:
            short = want - self.pool.allocator.available_pages()
            if short > 0:
                self.host.evict(short)
            pages = self.pool.allocator.alloc(min(want, self.pool.allocator.available_pages()))
        finally:
            self.host.dec_lock_ref(match.last_node)
        if not pages:
            return None
        end = have + len(pages) * ps
        done = self.pool.write((slots[have:end:ps] // ps).tolist(), pages)
        self.host.cache_finished_req(tokens[:end], joined(match.slots, page_slots(pages, ps)), None)
        self._backed_up(tokens[:end], have // ps, pages)
        return done

    def _backed_up(self, tokens: list[int], first: int, host_pages: list[int]) -> None:
        """Pages first.. of `tokens` were just copied into `host_pages` (the store tier writes them out)."""

    # -- the device tree's interface -------------------------------------------------------------
    def inc_lock_ref(self, node: Any) -> None:
        self.device.inc_lock_ref(node)

    def dec_lock_ref(self, node: Any) -> None:
        self.device.dec_lock_ref(node)

    def cache_finished_req(self, token_ids: list[int], slots: torch.Tensor, last_node: Any) -> None:
        self._release_written()
        self.device.cache_finished_req(token_ids, slots, last_node)
        if self.write_policy == "write_through":
            n = len(token_ids) // self.page_size * self.page_size
            if n:
                match = self.device.match_prefix(token_ids[:n])
                done = self._backup(token_ids[:n], match.slots)
                if done is not None:  # its pages stay in the device tree until the copy has read them
                    self.device.inc_lock_ref(match.last_node)
                    self.writing.append((done, match.last_node))

    def evict(self, num_pages: int) -> int:
        self._release_written()
        return self.device.evict(num_pages)

    def evictable_pages(self) -> int:
        return self.device.evictable_pages()

    def locked_pages(self) -> int:
        return self.device.locked_pages()

    # -- the host tier ---------------------------------------------------------------------------
    def host_counts(self) -> dict[str, int]:
        return {
            "total": self.pool.num_pages,
            "free": self.pool.allocator.available_pages(),
            "cached": self.host.evictable_pages(),
            "locked": self.host.locked_pages(),
            "written": self.pool.pages_written,
            "loaded": self.pool.pages_loaded,
            "hit_tokens": self.host_hit_tokens,
        }

    def check_integrity(self) -> None:
        self.device.check_integrity()
        self.pool.check_integrity()
        self.host.check_integrity()
        c = self.host_counts()
        if c["free"] + c["cached"] + c["locked"] != c["total"]:
            raise MemoryIntegrityError(
                f"host page leak: free {c['free']} + cached {c['cached']} + locked {c['locked']} != total {c['total']}"
            )


def host_pool_pages(config: Any, device_pages: int, bytes_per_page: int) -> int:
    """--hicache-size GiB of pages when given, else --hicache-ratio x the device pool's pages."""
    if config.hicache_size > 0:
        return int(config.hicache_size * 2**30 // bytes_per_page)
    return int(config.hicache_ratio * device_pages)


def check_host_memory(nbytes: int) -> None:
    """Refuse a host tier larger than the memory the host has available now (as SGLang does)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if nbytes > available:
        raise UserError(
            f"the host tier needs {nbytes / 2**30:.1f} GiB and the host has {available / 2**30:.1f} GiB available: "
            "lower --hicache-ratio or --hicache-size"
        )
