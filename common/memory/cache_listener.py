"""The one narrow interface through which a prefix cache reports what it holds (KV cache events).

Calls come on the scheduler thread and must return at once: a listener queues and does its work elsewhere.
`tokens` always starts at the root of the cache: `tokens[:start]` is the cached prefix the change hangs off,
`tokens[start:]` (whole pages) the pages stored or removed. The caller gives up `tokens`; the listener may keep it.
`medium` names the tier, as vLLM's events do: DEVICE_MEDIUM for the pool forwards read (vLLM's block pool says
"GPU" on every platform, so on a CPU server too, where the "device" pool is the small fast tier in host memory),
HOST_MEDIUM for the host tier behind it (vLLM's CPU offloading says "CPU"), STORE_MEDIUM for the store every
server shares behind that (--hicache-storage-backend: the page can be read by any server of the store, not only
the one that reports it; only `stored` is reported, as a server never learns what the store evicts).
"""

from __future__ import annotations

from typing import Protocol

DEVICE_MEDIUM = "GPU"
HOST_MEDIUM = "CPU"
STORE_MEDIUM = "STORE"


class CacheListener(Protocol):
    def stored(self, tokens: list[int], start: int, medium: str) -> None:
        """Pages tokens[start:] entered the `medium` tier under the cached prefix tokens[:start]."""

    def removed(self, tokens: list[int], start: int, medium: str) -> None:
        """Pages tokens[start:] (under the prefix tokens[:start]) left the `medium` tier."""

    def cleared(self) -> None:
        """Every page left the cache (a tier's tree started or was reset: subscribers forget every tier)."""
