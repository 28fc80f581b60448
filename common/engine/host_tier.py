"""What a server shows of its host tier (`--enable-hierarchical-cache`) and of the KV store behind it
(`--hicache-storage-backend`): the start-up words, the /get_server_info entries and the /metrics gauges. Every
function is a no-op without the tier."""

from __future__ import annotations

from common.engine.metrics import EngineMetrics
from common.memory.hicache import HiRadixCache
from common.memory.prefix_cache import PrefixCache
from common.memory.store.store_cache import StoreRadixCache

STATES = ("total", "free", "cached", "locked", "prefetching")
COPIES = ("written", "loaded", "hit_tokens")
STORE_COUNTS = (
    "pages_read",
    "pages_written",
    "bytes_read",
    "bytes_written",
    "hit_tokens",
    "refused",
    "corrupt",
    "skipped",
)


def summary(cache: PrefixCache) -> str:
    """Appended to the start-up summary: "; host tier: ..." or ""."""
    return f"; {cache.pool.describe()}, {cache.write_policy}" if isinstance(cache, HiRadixCache) else ""


def info(cache: PrefixCache) -> dict[str, int] | None:
    """The host tier's pages and copies since start, or None."""
    return cache.host_counts() if isinstance(cache, HiRadixCache) else None


def store_info(cache: PrefixCache) -> dict | None:
    """The store tier's counts since start (and whether it is reachable now), or None."""
    return cache.store_counts() if isinstance(cache, StoreRadixCache) else None


def register_gauges(metrics: EngineMetrics, cache: PrefixCache) -> None:
    if not isinstance(cache, HiRadixCache):
        return
    if isinstance(cache, StoreRadixCache):
        register_store_gauges(metrics, cache)
    metrics.labelled_gauges(
        "tandem_host_tier_pages",
        "host tier pages (total = free + cached + locked + prefetching)",
        "state",
        lambda: {k: v for k, v in cache.host_counts().items() if k in STATES},
    )
    metrics.labelled_gauges(
        "tandem_host_tier_copies",
        "since start: pages written to the host tier (written), pages loaded back (loaded), prefix tokens "
        "matched there (hit_tokens)",
        "kind",
        lambda: {k: v for k, v in cache.host_counts().items() if k in COPIES},
    )


def register_store_gauges(metrics: EngineMetrics, cache: StoreRadixCache) -> None:
    metrics.labelled_gauges(
        "tandem_kv_store",
        "since start: pages and bytes read from and written to the KV store, prefix tokens it supplied "
        "(hit_tokens), pages it did not take (refused: full), pages refused by their integrity check (corrupt), jobs "
        "skipped while it was unavailable",
        "kind",
        lambda: {k: v for k, v in cache.store_counts().items() if k in STORE_COUNTS},
    )
    metrics.gauge("tandem_kv_store_available", "1 while the KV store is reachable", lambda: int(cache.tier.available))
