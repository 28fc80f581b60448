"""What a server shows of its host tier (`--enable-hierarchical-cache`): the start-up words, the
/get_server_info entry and the /metrics gauges. Every function is a no-op without the tier."""

from __future__ import annotations

from common.engine.metrics import EngineMetrics
from common.memory.hicache import HiRadixCache
from common.memory.prefix_cache import PrefixCache

STATES = ("total", "free", "cached", "locked")
COPIES = ("written", "loaded", "hit_tokens")


def summary(cache: PrefixCache) -> str:
    """Appended to the start-up summary: "; host tier: ..." or ""."""
    return f"; {cache.pool.describe()}, {cache.write_policy}" if isinstance(cache, HiRadixCache) else ""


def info(cache: PrefixCache) -> dict[str, int] | None:
    """The host tier's pages and copies since start, or None."""
    return cache.host_counts() if isinstance(cache, HiRadixCache) else None


def register_gauges(metrics: EngineMetrics, cache: PrefixCache) -> None:
    if not isinstance(cache, HiRadixCache):
        return
    metrics.labelled_gauges(
        "tandem_host_tier_pages",
        "host tier pages (total = free + cached + locked)",
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
