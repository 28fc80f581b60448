"""Builds the three-tier prefix cache from a ServerConfig: the backend its flags name, the worker, the cache."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from common.memory.allocator import PagedAllocator
from common.memory.cache_listener import CacheListener
from common.memory.host_pool import HostPool
from common.memory.store.backend import FileStore, StoreBackend
from common.memory.store.config import MooncakeConfig, parse_store_config
from common.memory.store.store_cache import StoreRadixCache
from common.memory.store.tier import StoreTier

log = logging.getLogger(__name__)


def store_backend(config: Any, host_pool: HostPool) -> tuple[StoreBackend, Any]:
    """The backend `--hicache-storage-backend` names, and its parsed extra config."""
    store_config = parse_store_config(config.hicache_storage_backend, config.hicache_storage_backend_extra_config)
    if isinstance(store_config, MooncakeConfig):
        from common.memory.store.mooncake import MooncakeStore

        return MooncakeStore(store_config, host_pool.buffer, config.public_host), store_config
    return FileStore(store_config.file_path), store_config


def make_store_cache(
    config: Any,
    allocator: PagedAllocator,
    host_pool: HostPool,
    listener: CacheListener | None,
    namespace: str,
    wake: Callable[[], None],
    adapter_name: Callable[[int], str | None] = lambda lora_id: None,
) -> StoreRadixCache:
    backend, store_config = store_backend(config, host_pool)
    tier = StoreTier(
        backend,
        host_pool.buffer,
        namespace,
        config.page_size,
        store_config.io_timeout_s,
        store_config.retry_interval_s,
        wake,
    )
    read = config.disaggregation_mode != "decode"
    log.info(
        "KV store: %s, pages named tandem-%s-*, %s, prefetch %s",
        backend.describe(),
        namespace,
        "read and written" if read else "written only (a decode)",
        config.hicache_storage_prefetch_policy,
    )
    return StoreRadixCache(
        allocator,
        host_pool,
        config.hicache_write_policy,
        listener,
        tier=tier,
        config=store_config,
        policy=config.hicache_storage_prefetch_policy,
        read=read,
        adapter_name=adapter_name,
    )
