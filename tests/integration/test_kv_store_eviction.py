"""A full Mooncake Store evicts: the store tier in process (no model) on a real master and a memory-holding
client whose segment (16 MiB, Mooncake's least) holds about 30 pages of 512 KiB; ten prompts of 4 pages each
are written in turn, each once the master has made room for it (past its high watermark, here half full, it
evicts the least recently used third of its objects, about once a second; leases keep what is being read). All 40 pages are taken, the newest prompt reads back whole and byte for byte, the oldest not at all,
and the caches keep their books."""

from __future__ import annotations

import time

import pytest
import torch

from common.core.request import Req
from common.memory.allocator import PagedAllocator
from common.memory.host_pool import HostPool
from common.memory.kv_pool import KVPool
from common.memory.store.config import parse_store_config
from common.memory.store.mooncake import MooncakeStore
from common.memory.store.store_cache import StoreRadixCache
from common.memory.store.tier import StoreTier
from common.wire.sampling_params import SamplingParams
from tests.integration.kv_store_procs import MooncakeStoreProcs

PS, PAGES = 16, 4
PAGE_BYTES = 4 * 2 * PS * 8 * 128 * 4


@pytest.fixture(scope="module")
def store():
    pytest.importorskip("mooncake.store")
    procs = MooncakeStoreProcs(size="16MB", lease_ttl_ms=500, name="kv-store-small", eviction=(0.5, 0.3))
    yield procs
    procs.stop()


def make(store) -> tuple[StoreRadixCache, KVPool]:
    pool = KVPool(4, 4 * PAGES, PS, 8, 128, torch.float32, "cpu")  # 512 KiB a page
    host = HostPool(pool, 8 * PAGES)
    config = parse_store_config("mooncake", store.extra_config(prefetch_threshold=0, retry_interval_s=0.2))
    backend = MooncakeStore(config, host.buffer, "127.0.0.1")
    tier = StoreTier(backend, host.buffer, "evict", PS, 5.0, 0.2)
    cache = StoreRadixCache(
        PagedAllocator(4 * PAGES, PS),
        host,
        "write_through",
        None,
        tier=tier,
        config=config,
        policy="wait_complete",
        read=True,
    )
    wait_for(lambda: tier.available)
    return cache, pool


def wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def settle(cache: StoreRadixCache) -> None:
    def idle() -> bool:
        cache.poll()
        return not cache.waiting and cache.host.locked_pages() == 0 and cache.prefetching == 0

    wait_for(idle)


def write(cache: StoreRadixCache, pool: KVPool, tokens: list[int]) -> None:
    """A request computed `tokens` (its KV: the token ids) and finished; its pages go to the host and the store."""
    cache.evict(cache.evictable_pages())
    slots = cache.allocator.alloc_token_slots(0, len(tokens), -1)
    kv = torch.tensor(tokens, dtype=torch.float32)[:, None, None].expand(-1, 8, 128)
    for layer in range(pool.num_layers):
        pool.set_kv(layer, pool.locate(slots), kv, -kv)
    cache.cache_finished_req(tokens, slots, cache.device.root)
    settle(cache)


def test_a_full_store_evicts_the_oldest_pages_and_keeps_taking_new_ones(store):
    writer, writer_pool = make(store)
    prompts = [list(range(base, base + PAGES * PS)) for base in range(1000, 11000, 1000)]
    for prompt in prompts:
        wait_for(lambda: store.free_bytes() >= PAGES * (PAGE_BYTES + 64) * 1.15)  # under the watermark after it
        write(writer, writer_pool, prompt)
    assert writer.tier.counts["pages_written"] == 10 * PAGES  # more than the store holds at once
    reader, reader_pool = make(store)
    reader.prefetch(Req("newest", prompts[-1], SamplingParams()), prompts[-1])
    settle(reader)
    match = reader.match_prefix(prompts[-1])
    assert len(match.slots) == PAGES * PS and reader.tier.counts["corrupt"] == 0
    k = reader_pool.k_at(3, reader_pool.locate(match.slots))[:, 5, 7]
    assert k.tolist() == [float(t) for t in prompts[-1]]
    reader.prefetch(Req("oldest", prompts[0], SamplingParams()), prompts[0])
    settle(reader)
    assert reader.store_hit_tokens == PAGES * PS  # nothing of the oldest prompt was left
    for cache in (writer, reader):
        cache.check_integrity()
        cache.close()
