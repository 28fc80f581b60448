"""The hierarchical prefix cache with the store behind its host tier (`--hicache-storage-backend`).

    device tree   pages of the device pool                        (common/memory/radix_cache.py)
    host tree     pages of the host pool                          (common/memory/hicache.py)
    store         objects keyed by chained page digest, shared     (common/memory/store/tier.py)

Writes: every run of pages copied into the host tier (on caching with write_through, on eviction with
write_back) is written out by the tier's worker; its host node stays locked until the job is collected, so
the pages are not reused while read. Reads: a request queued for prefill (`prefetch`) gets host pages for
the part of its prompt that neither tier holds; the worker reads what the store has into them; collected
(`poll`, once per step), the verified leading pages enter the host tree and the rest are freed. When the
request is admitted, `match_prefix` loads them into the device as any host hit. `ready` says whether a
queued request may be admitted yet (--hicache-storage-prefetch-policy).

Who frees what (host pages a job holds):

    write job   pages in the host tree, node locked       -> poll(): unlocked (the host tree frees them later)
    read job    pages in no tree, counted as prefetching  -> poll(): verified leading pages into the host
                                                             tree (duplicates freed), the rest freed
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.core.request import Req, key_lora_id
from common.memory.cache_listener import STORE_MEDIUM
from common.memory.errors import MemoryIntegrityError
from common.memory.hicache import HiRadixCache, joined, page_slots
from common.memory.store.config import TierConfig
from common.memory.store.tier import StoreJob, StoreTier


@dataclass
class Prefetch:
    req: Req  # the request waiting for it
    node: Any  # the host node of the part already on the host: locked until collected
    slots: torch.Tensor  # that part's host slots
    deadline: float  # --hicache-storage-prefetch-policy timeout: admitted from then on
    done: bool = False


class StoreRadixCache(HiRadixCache):
    def __init__(
        self,
        *args: Any,
        tier: StoreTier,
        config: TierConfig,
        policy: str,
        read: bool,
        adapter_name: Callable[[int], str | None] = lambda lora_id: None,
        **kwargs: Any,
    ):
        """`read`: prefetch from the store (prefill and monolithic servers; a decode only writes); `adapter_name`:
        a lora_id's adapter (--enable-lora), whose name keys its pages in the store (keys.py)."""
        super().__init__(*args, **kwargs)
        self.tier, self.store_config, self.policy, self.read = tier, config, policy, read
        self.adapter_name = adapter_name
        self.waiting: dict[Req, Prefetch] = {}  # request -> its prefetch in flight
        self.prefetching = 0  # host pages read jobs hold
        self.store_hit_tokens = 0  # tokens read from the store into the host tier

    # -- writes ----------------------------------------------------------------------------------
    def _backed_up(self, tokens: list[int], first: int, host_pages: list[int]) -> None:
        node = self.host.match_prefix(tokens).last_node
        self.host.inc_lock_ref(node)
        copied = None
        if self.pool.stream is not None:  # the copies to the host run on the pool's stream: the worker waits
            copied = torch.cuda.Event()
            copied.record(self.pool.stream)
        self.tier.submit(StoreJob("write", tokens, first, host_pages, node, copied, lora_name=self._lora_name(tokens)))

    # -- reads -----------------------------------------------------------------------------------
    def prefetch(self, req: Req, token_ids: list[int]) -> None:
        """Start reading the part of `token_ids` neither tier holds from the store, for `req`."""
        if not self.read or not self.tier.available or req in self.waiting:
            return
        ps, host = self.page_size, self.host.match_prefix(token_ids)
        have = max(len(host.slots), len(self.device.match_prefix(token_ids).slots))
        want = (len(token_ids) - len(host.slots)) // ps
        if len(token_ids) // ps * ps - have < max(self.store_config.prefetch_threshold, ps):
            return
        self.host.inc_lock_ref(host.last_node)
        short = want - self.pool.allocator.available_pages()
        if short > 0:
            self.host.evict(short)
        pages = self.pool.allocator.alloc(min(want, self.pool.allocator.available_pages()))
        if not pages:
            self.host.dec_lock_ref(host.last_node)
            return
        c = self.store_config
        deadline = time.monotonic() + c.prefetch_timeout_base + c.prefetch_timeout_per_ki_token * want * ps / 1024
        job = Prefetch(req, host.last_node, host.slots, deadline)
        self.waiting[req] = job
        self.prefetching += len(pages)
        end = len(host.slots) + len(pages) * ps
        lora_name = self._lora_name(token_ids)
        self.tier.submit(
            StoreJob("read", token_ids[:end], len(host.slots) // ps, pages, owner=job, lora_name=lora_name)
        )

    def _lora_name(self, keys: list[int]) -> str | None:
        """The adapter whose namespace `keys` are in (named on this thread: adapters load and unload on it)."""
        lora_id = key_lora_id(keys)
        return self.adapter_name(lora_id) if lora_id else None

    def ready(self, req: Req) -> bool:
        """Whether `req` may be admitted now: no prefetch of its own in flight, or the policy lets it go."""
        job = self.waiting.get(req)
        if job is None or self.policy == "best_effort" or not self.tier.available:
            return True
        return self.policy == "timeout" and time.monotonic() >= job.deadline

    def poll(self) -> None:
        for job in self.tier.finished():
            (self._read_done if job.kind == "read" else self._write_done)(job)

    def _read_done(self, job: StoreJob) -> None:
        pre: Prefetch = job.owner
        if self.waiting.get(pre.req) is pre:
            del self.waiting[pre.req]
        ok, ps = job.pages_ok, self.page_size
        self.prefetching -= len(job.host_pages)
        if ok:
            tokens = job.tokens[: len(pre.slots) + ok * ps]
            self.host.cache_finished_req(tokens, joined(pre.slots, page_slots(job.host_pages[:ok], ps)), None)
            self.store_hit_tokens += ok * ps
            pre.req.store_hit_len = ok * ps
        self.pool.allocator.free(job.host_pages[ok:])
        self.host.dec_lock_ref(pre.node)

    def _write_done(self, job: StoreJob) -> None:
        self.host.dec_lock_ref(job.owner)
        if job.pages_ok and self.host.listener is not None:
            end = (job.first + job.pages_ok) * self.page_size
            self.host.listener.stored(job.tokens[:end], job.first * self.page_size, STORE_MEDIUM)

    # -- accounting ------------------------------------------------------------------------------
    def host_counts(self) -> dict[str, int]:
        return {**super().host_counts(), "prefetching": self.prefetching}

    def store_counts(self) -> dict[str, Any]:
        return {
            **self.tier.counts,
            "backend": self.tier.backend.describe(),
            "namespace": self.tier.namespace,
            "available": self.tier.available,
            "hit_tokens": self.store_hit_tokens,
            "waiting": len(self.waiting),
        }

    def check_integrity(self) -> None:
        self.device.check_integrity()
        self.pool.check_integrity()
        self.host.check_integrity()
        c = self.host_counts()
        if c["free"] + c["cached"] + c["locked"] + c["prefetching"] != c["total"]:
            raise MemoryIntegrityError(
                f"host page leak: free {c['free']} + cached {c['cached']} + locked {c['locked']} + prefetching "
                f"{c['prefetching']} != total {c['total']}"
            )

    def close(self) -> None:
        self.tier.close()
