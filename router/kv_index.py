"""The exact index of which worker holds which KV page, built from the workers' KV cache events.

Block hashes are chained (common/wire/kv_events.py), so a worker holds a prompt's first k pages exactly when
it holds their k hashes; a radix cache evicts leaves first, so what a worker holds of a prompt is a prefix and
`matched` counts leading hashes. Every router process applies the same events in the same order per worker,
so every process holds the same index.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVIndex:
    def __init__(self) -> None:
        self.holders: dict[int, set[str]] = {}  # block hash -> urls of the workers that hold it
        self.blocks: dict[str, set[int]] = {}  # worker url -> the block hashes it holds

    def stored(self, worker: str, hashes: Iterable[int]) -> None:
        mine = self.blocks.setdefault(worker, set())
        for h in hashes:
            mine.add(h)
            self.holders.setdefault(h, set()).add(worker)

    def removed(self, worker: str, hashes: Iterable[int]) -> None:
        mine = self.blocks.get(worker)
        if not mine:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                self._forget(h, worker)

    def clear(self, worker: str) -> None:
        """Forget all of one worker's pages (it cleared its cache, restarted, or its events had a gap)."""
        for h in self.blocks.pop(worker, set()):
            self._forget(h, worker)

    def _forget(self, h: int, worker: str) -> None:
        owners = self.holders[h]
        owners.discard(worker)
        if not owners:
            del self.holders[h]

    def matched(self, worker: str, hashes: list[int]) -> int:
        """How many of a prompt's leading pages (given by their chained hashes) the worker holds."""
        mine = self.blocks.get(worker)
        if not mine:
            return 0
        n = 0
        for h in hashes:
            if h not in mine:
                break
            n += 1
        return n

    def pages(self, worker: str) -> int:
        return len(self.blocks.get(worker, ()))

    def apply(self, worker: str, events: list[list]) -> None:
        """One decoded EventBatch's events (tagged arrays, common/wire/kv_events.py) from `worker`."""
        for event in events:
            tag = event[0]
            if tag == "BlockStored":
                self.stored(worker, event[1])
            elif tag == "BlockRemoved":
                self.removed(worker, event[1])
            elif tag == "AllBlocksCleared":
                self.clear(worker)
