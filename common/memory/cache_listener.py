"""The one narrow interface through which a prefix cache reports what it holds (KV cache events).

Calls come on the scheduler thread and must return at once: a listener queues and does its work elsewhere.
`tokens` always starts at the root of the cache: `tokens[:start]` is the cached prefix the change hangs off,
`tokens[start:]` (whole pages) the pages stored or removed. The caller gives up `tokens`; the listener may keep it.
"""

from __future__ import annotations

from typing import Protocol


class CacheListener(Protocol):
    def stored(self, tokens: list[int], start: int) -> None:
        """Pages tokens[start:] entered the cache under the cached prefix tokens[:start]."""

    def removed(self, tokens: list[int], start: int) -> None:
        """Pages tokens[start:] (under the prefix tokens[:start]) left the cache."""

    def cleared(self) -> None:
        """Every page left the cache."""
