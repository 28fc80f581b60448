"""The exact index of which worker holds which KV page, built from the workers' KV cache events.

Block hashes are chained (common/wire/kv_events.py), so a worker holds a prompt's first k pages exactly when
it holds their k hashes; a radix cache evicts leaves first, so what a worker holds of a prompt is a prefix and
`matched` counts leading hashes. A worker holds a page while any of its tiers does (the event's `medium`: a
host tier's page is loaded back rather than recomputed), so a page the device evicts after copying it to the
host stays held. Every router process applies the same events in the same order per worker,
so every process holds the same index.

The KV store every server shares (medium "STORE", --hicache-storage-backend) is one tier of the whole cluster,
not of a worker: its pages are kept apart (`store`), and a worker that reports store pages ("a store user")
can read every page in it. A server never learns what the store evicts, so the store's set is bounded
(least recently stored first out): it may over-count what the store still holds, and a worker then reads
what it finds and computes the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

STORE = "STORE"
STORE_PAGES = 1 << 18  # the store's pages the index remembers


class KVIndex:
    def __init__(self, store_pages: int = STORE_PAGES) -> None:
        self.holders: dict[int, set[str]] = {}  # block hash -> urls of the workers that hold it
        self.blocks: dict[str, dict[int, set[str]]] = {}  # worker url -> block hash -> the tiers holding it
        self.store: OrderedDict[int, None] = OrderedDict()  # block hashes in the shared store
        self.store_users: set[str] = set()  # workers that write to (and read from) the store
        self.store_pages = store_pages

    def stored(self, worker: str, hashes: Iterable[int], medium: str = "GPU") -> None:
        if medium == STORE:
            self._stored_in_store(worker, hashes)
            return
        mine = self.blocks.setdefault(worker, {})
        for h in hashes:
            mine.setdefault(h, set()).add(medium)
            self.holders.setdefault(h, set()).add(worker)

    def _stored_in_store(self, worker: str, hashes: Iterable[int]) -> None:
        self.store_users.add(worker)
        for h in hashes:
            self.store[h] = None
            self.store.move_to_end(h)
        while len(self.store) > self.store_pages:
            self.store.popitem(last=False)

    def removed(self, worker: str, hashes: Iterable[int], medium: str = "GPU") -> None:
        if medium == STORE:
            for h in hashes:
                self.store.pop(h, None)
            return
        mine = self.blocks.get(worker)
        if not mine:
            return
        for h in hashes:
            media = mine.get(h)
            if media is not None and medium in media:
                media.discard(medium)
                if not media:
                    del mine[h]
                    self._forget(h, worker)

    def clear(self, worker: str) -> None:
        """Forget all of one worker's pages (it cleared its cache, restarted, or its events had a gap)."""
        for h in self.blocks.pop(worker, {}):
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

    def credit(self, worker: str, hashes: list[int], weights: dict[str, float], store_weight: float = 0.0) -> float:
        """A prompt's leading pages the worker can reuse, each weighed by the best tier it is in (`weights` by
        medium, 1 for one not named; `store_weight` for a page only the shared store holds, if the worker uses
        it): what kv_aware subtracts from the pages it must compute."""
        mine, total = self.blocks.get(worker, {}), 0.0
        in_store = store_weight > 0 and worker in self.store_users
        for h in hashes:
            media = mine.get(h)
            if media:
                total += max(weights.get(m, 1.0) for m in media)
            elif in_store and h in self.store:
                total += store_weight
            else:
                break
        return total

    def pages(self, worker: str) -> int:
        return len(self.blocks.get(worker, ()))

    def apply(self, worker: str, events: list[list]) -> None:
        """One decoded EventBatch's events (tagged arrays, common/wire/kv_events.py) from `worker`."""
        for event in events:
            tag = event[0]
            if tag == "BlockStored":
                self.stored(worker, event[1], *event[6:7])  # the medium, when the event has one
            elif tag == "BlockRemoved":
                self.removed(worker, event[1], *event[2:3])
            elif tag == "AllBlocksCleared":
                self.clear(worker)
