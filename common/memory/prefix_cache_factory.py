"""Which prefix cache a server runs: NoPrefixCache when --disable-radix-cache is set, else the radix cache
(common/memory/radix_cache.py), with a host tier behind it under --enable-hierarchical-cache
(common/memory/hicache.py) and a store every server shares behind that under --hicache-storage-backend
(common/memory/store/store_cache.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.memory.allocator import PagedAllocator
from common.memory.cache_listener import CacheListener
from common.memory.hicache import HiRadixCache, check_host_memory, host_pool_pages
from common.memory.host_pool import HostPool
from common.memory.prefix_cache import NoPrefixCache, PrefixCache
from common.memory.radix_cache import RadixCache


def make_prefix_cache(
    config: Any,
    allocator: PagedAllocator,
    kv_pool: Any,
    listener: CacheListener | None = None,
    namespace: str = "",
    wake: Callable[[], None] = lambda: None,
    adapter_name: Callable[[int], str | None] = lambda lora_id: None,
) -> PrefixCache:
    """The server's prefix cache: none, the device radix cache, both tiers, or all three (`config`: a ServerConfig);
        `listener` (KV cache events) hears of every tier's pages, each with its medium. With a store: `namespace`
        names this server's pages in it (common/memory/store/keys.py), `wake` wakes the scheduler when store work ends,
    `adapter_name` names a LoRA adapter by its lora_id (its pages' store keys digest its name)."""
    if config.disable_radix_cache:
        return NoPrefixCache(allocator, config.page_size)
    if not config.enable_hierarchical_cache:
        return RadixCache(allocator, config.page_size, listener)
    pages = host_pool_pages(config, allocator.num_pages, kv_pool.bytes_per_page)
    check_host_memory(pages * kv_pool.bytes_per_page)
    if config.hicache_storage_backend:
        from common.memory.store.factory import make_store_cache

        return make_store_cache(config, allocator, HostPool(kv_pool, pages), listener, namespace, wake, adapter_name)
    return HiRadixCache(allocator, HostPool(kv_pool, pages), config.hicache_write_policy, listener)
