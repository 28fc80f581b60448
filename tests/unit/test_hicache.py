"""The host tier without a model: pages evicted from the device tree are copied to the host pool and
loaded back, byte for byte, by a later match; both tiers keep their books."""

from __future__ import annotations

import pytest
import torch

from common.config import ServerConfig
from common.memory.allocator import PagedAllocator
from common.memory.hicache import HiRadixCache
from common.memory.host_pool import HostPool
from common.memory.kv_pool import KVPool
from common.memory.prefix_cache_factory import make_prefix_cache
from common.wire.page_runs import page_runs
from common.wire.user_error import UserError

PS = 4


def make(device_pages: int, host_pages: int, policy: str) -> tuple[HiRadixCache, KVPool]:
    pool = KVPool(2, device_pages, PS, 1, 2, torch.float32, "cpu")
    return HiRadixCache(PagedAllocator(device_pages, PS), HostPool(pool, host_pages), policy), pool


def finish(cache: HiRadixCache, pool: KVPool, tokens: list[int]) -> torch.Tensor:
    """A request that matched nothing computes `tokens` (KV = its token ids) and hands its pages over."""
    slots = cache.allocator.alloc_token_slots(0, len(tokens), -1)
    at = pool.locate(slots)
    for layer in range(pool.num_layers):
        kv = torch.tensor(tokens, dtype=torch.float32)[:, None, None].expand(-1, 1, 2) + layer
        pool.set_kv(layer, at, kv, -kv)
    cache.cache_finished_req(tokens, slots, cache.device.root)
    return slots


def kv_of(pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
    at = pool.locate(slots)
    return torch.stack([pool.k_at(layer, at)[:, 0, 0] - layer for layer in range(pool.num_layers)])


def test_page_runs_join_pages_that_go_up_together():
    assert [x.tolist() for x in page_runs([3, 4, 5, 9], [1, 2, 3, 4])] == [[3, 9], [1, 4], [3, 1]]
    assert [x.tolist() for x in page_runs([], [])] == [[], [], []]
    with pytest.raises(ValueError):
        page_runs([1], [])


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_an_evicted_prefix_is_loaded_back_from_the_host_with_its_kv(policy):
    cache, pool = make(device_pages=4, host_pages=16, policy=policy)
    a, b = list(range(100, 116)), list(range(200, 216))  # 4 pages each: the device holds one of them
    finish(cache, pool, a)
    assert cache.pool.pages_written == (4 if policy == "write_through" else 0)
    cache.evict(4)
    finish(cache, pool, b)  # a is on the host only now
    assert cache.pool.pages_written == (8 if policy == "write_through" else 4)
    cache.check_integrity()
    match = cache.match_prefix(a + [1, 2])
    assert len(match.slots) == 16 and cache.host_hit_tokens == 16 and cache.pool.pages_loaded == 4
    assert kv_of(pool, match.slots).tolist() == [[float(t) for t in a]] * 2
    assert cache.pool.pages_written == 8  # loading a evicted b, which the host had or got
    cache.check_integrity()
    assert len(cache.match_prefix(b).slots) == 16  # and b comes back in its turn
    assert kv_of(pool, cache.match_prefix(b).slots).tolist() == [[float(t) for t in b]] * 2
    cache.check_integrity()


def test_a_locked_device_prefix_stays_and_only_the_rest_is_loaded():
    cache, pool = make(device_pages=6, host_pages=16, policy="write_back")
    shared = list(range(8))
    finish(cache, pool, shared + list(range(50, 58)))
    cache.evict(6)
    finish(cache, pool, shared + [9] * 4)  # shared is back on the device (recomputed), its tail not
    first = cache.match_prefix(shared)
    cache.inc_lock_ref(first.last_node)
    match = cache.match_prefix(shared + list(range(50, 58)))
    assert len(match.slots) == 16 and cache.host_hit_tokens == 8  # the two tail pages came from the host
    assert match.slots[:8].tolist() == first.slots.tolist()
    cache.dec_lock_ref(first.last_node)
    cache.check_integrity()


def test_a_full_host_tier_drops_its_least_recently_used_pages():
    cache, pool = make(device_pages=4, host_pages=4, policy="write_back")
    for base in (100, 200, 300):
        finish(cache, pool, list(range(base, base + 16)))
        cache.evict(4)
    cache.check_integrity()
    assert cache.host_counts()["cached"] == 4 and cache.host_counts()["free"] == 0
    assert len(cache.match_prefix(list(range(100, 116))).slots) == 0  # the oldest went
    assert len(cache.match_prefix(list(range(300, 316))).slots) == 16
    cache.check_integrity()


@pytest.mark.parametrize(
    "flags", [{"disable_radix_cache": True}, {"tp_size": 2}], ids=["without-radix-cache", "tensor-parallel"]
)
def test_the_host_tier_is_refused_where_it_cannot_work(flags):
    with pytest.raises(ValueError, match="--enable-hierarchical-cache needs the radix cache and --tp-size 1"):
        ServerConfig(enable_hierarchical_cache=True, **flags)


def test_the_host_tier_is_sized_by_gib_or_by_ratio():
    pool = KVPool(2, 10, PS, 1, 2, torch.float32, "cpu")
    by_ratio = make_prefix_cache(
        ServerConfig(enable_hierarchical_cache=True, hicache_ratio=3), PagedAllocator(10, PS), pool
    )
    assert by_ratio.pool.num_pages == 30 and by_ratio.write_policy == "write_through"
    gib = 100 * pool.bytes_per_page / 2**30
    by_size = make_prefix_cache(
        ServerConfig(enable_hierarchical_cache=True, hicache_size=gib, hicache_write_policy="write_back"),
        PagedAllocator(10, PS),
        pool,
    )
    assert by_size.pool.num_pages == 100 and by_size.write_policy == "write_back"
    assert type(make_prefix_cache(ServerConfig(), PagedAllocator(10, PS), pool)).__name__ == "RadixCache"


def test_a_host_tier_larger_than_the_hosts_memory_is_refused():
    pool = KVPool(2, 10, PS, 1, 2, torch.float32, "cpu")
    huge = ServerConfig(enable_hierarchical_cache=True, hicache_size=10**7)  # 10 PiB
    with pytest.raises(UserError, match="lower --hicache-ratio or --hicache-size"):
        make_prefix_cache(huge, PagedAllocator(10, PS), pool)


class FakeCopy:
    """A copy's CUDA event: passed once `landed` is set; synchronize() waits for it (here: lands it)."""

    def __init__(self):
        self.landed = self.waited = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.waited = self.landed = True


class AsyncHostPool(HostPool):
    """HostPool whose writes land only when told (as on CUDA, where the compute stream goes on)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.copies: list[FakeCopy] = []

    def write(self, device_pages, host_pages):
        super().write(device_pages, host_pages)
        self.copies.append(FakeCopy())
        return self.copies[-1]


def test_a_write_through_copy_locks_its_device_pages_until_it_lands_and_an_eviction_copy_is_waited_for():
    pool = KVPool(2, 8, PS, 1, 2, torch.float32, "cpu")
    host = AsyncHostPool(pool, 16)
    cache = HiRadixCache(PagedAllocator(8, PS), host, "write_through")
    finish(cache, pool, list(range(8)))  # two pages, copied out: not yet landed
    assert cache.locked_pages() == 2 and cache.evictable_pages() == 0 and cache.evict(2) == 0
    host.copies[0].landed = True
    assert cache.evict(2) == 2 and cache.locked_pages() == 0  # released, then evictable (the host has them)
    assert len(host.copies) == 1  # nothing copied again at eviction: written through already
    wb = HiRadixCache(PagedAllocator(8, PS), AsyncHostPool(pool, 16), "write_back")
    finish(wb, pool, list(range(100, 108)))
    assert wb.locked_pages() == 0 and not wb.pool.copies
    assert wb.evict(2) == 2 and wb.pool.copies[0].waited  # its pages were freed only after the copy
