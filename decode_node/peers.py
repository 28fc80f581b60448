"""Where is the prefill of a request? Bootstrap lookups, cached briefly, with the layout checked.

`find()` answers from the cache on the caller's thread when it can, so a request of steady traffic
never waits for a lookup: an entry is served for CACHE_TTL_S after the lookup that made it, and once
it is REFRESH_AFTER_S old the next request that uses it starts a new lookup in the background. So an
entry in use stays fresh, and a bootstrap that stopped answering (or a prefill it no longer lists) is
noticed within CACHE_TTL_S, as before: the first request after that waits for a lookup of its own,
which fails with the registry's answer. Lookups run on a small thread pool, one at a time per entry.

A prefill at another TP or DP size fits when its attention groups split the same KV heads: the first
lookup of an instance logs which prefill rank(s) of an attention group hold each decode rank's heads
(common.wire.kv_heads), the heads its writes will bring. A prefill with DP attention is paired with once
every one of its DP ranks is registered (`dp_ranks` of the registry's answer).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from bootstrap.client import lookup_prefill
from common.edge.tls import client_verify
from common.wire.api import Rendezvous
from common.wire.kv_heads import describe_sources, head_sources
from common.wire.kv_layout import layout_mismatch

log = logging.getLogger(__name__)

CACHE_TTL_S = 2.0
REFRESH_AFTER_S = 1.0
REGISTER_WAIT_S = 30.0
INSTANCE_WAIT_S = 2.0
Key = tuple[str | None, int | None, str | None]


@dataclass(frozen=True)
class PeerInfo:
    endpoint: str
    instance_id: str


def _done(peer: PeerInfo) -> Future[PeerInfo]:
    fut: Future[PeerInfo] = Future()
    fut.set_result(peer)
    return fut


def complete(entry: dict | None) -> bool:
    """A registry answer with every DP rank of the prefill registered (an answer without `dp_ranks`, by
    (engine_rank, dp_group), is one rank's: complete)."""
    return entry is not None and len(entry.get("dp_ranks", range(entry.get("dp_size", 1)))) >= entry.get("dp_size", 1)


class PeerDirectory:
    def __init__(self, layout: dict, secret: str | None, workers: int = 4, tls: str | bool | None = None):
        """`tls`: None to look up over http, else https verified against this CA bundle (True: the system's)."""
        self.layout = layout
        self.secret = secret
        self.scheme = "http" if tls is None else "https"
        self._cache: dict[Key, tuple[float, PeerInfo]] = {}  # when the lookup answered, what it said
        self._pending: dict[Key, Future[PeerInfo]] = {}
        self._generation = 0  # grows with every invalidate(): a lookup that started before it is not cached
        self._lock = threading.Lock()
        self._sources_logged: set[str] = set()  # prefill instances whose head sources were logged
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="peer-lookup")
        # keep-alive: a lookup is one round trip, not a new connection
        self._http = httpx.Client(timeout=5, verify=client_verify(True if tls is None else tls))

    def close(self) -> None:
        """Stop the lookups (the decode role ended: a role switch)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def find(self, rendezvous: Rendezvous) -> Future[PeerInfo]:
        """The request's prefill: a done future from the cache, else the future of a lookup."""
        key = (rendezvous.bootstrap_host, rendezvous.bootstrap_port, rendezvous.prefill_instance_id)
        with self._lock:
            hit = self._cache.get(key)
            age = time.monotonic() - hit[0] if hit else float("inf")
            if age >= CACHE_TTL_S:
                return self._start(key, rendezvous)
            if age >= REFRESH_AFTER_S:
                self._start(key, rendezvous)  # refresh ahead, off this request's path
            return _done(hit[1])

    def _start(self, key: Key, rendezvous: Rendezvous) -> Future[PeerInfo]:
        """The lookup of `key` in flight, or a new one (call with the lock held)."""
        fut = self._pending.get(key)
        if fut is None:
            fut = self._pending[key] = self._pool.submit(self._refresh, key, rendezvous)
        return fut

    def _refresh(self, key: Key, rendezvous: Rendezvous) -> PeerInfo:
        generation = self._generation
        try:
            peer = self.lookup(rendezvous)
            with self._lock:
                if generation == self._generation:
                    self._cache[key] = (time.monotonic(), peer)
            return peer
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def lookup(self, rendezvous: Rendezvous) -> PeerInfo:
        """Blocking, uncached; waits a while for a prefill that has not registered yet."""
        url = f"{self.scheme}://{rendezvous.bootstrap_host}:{rendezvous.bootstrap_port}"
        # a named instance was healthy when the router picked it: if it is gone, it is not coming back
        wait_s = INSTANCE_WAIT_S if rendezvous.prefill_instance_id else REGISTER_WAIT_S
        deadline = time.monotonic() + wait_s
        while not complete(entry := self._lookup(url, rendezvous.prefill_instance_id)):
            if time.monotonic() > deadline:
                iid = rendezvous.prefill_instance_id
                what = f"prefill {iid} was not" if iid else "no prefill rank was"
                if entry is not None:
                    what = f"prefill {iid} had DP ranks {entry['dp_ranks']} of dp_size {entry['dp_size']}, not all"
                raise RuntimeError(f"{what} registered at bootstrap {url} within {wait_s:g} s")
            time.sleep(0.2)
        mismatch = layout_mismatch(self.layout, entry)
        if mismatch:
            raise RuntimeError(f"refusing prefill at {url}: {mismatch}")
        self._log_sources(entry)
        return PeerInfo(f"tcp://{entry['rank_ip']}:{entry['rank_port']}", entry["instance_id"])

    def _log_sources(self, entry: dict) -> None:
        sizes = lambda layout: (layout["tp_size"], layout.get("dp_size", 1))  # noqa: E731
        if sizes(entry) == sizes(self.layout) or entry["instance_id"] in self._sources_logged:
            return
        self._sources_logged.add(entry["instance_id"])
        attn = lambda layout: layout["tp_size"] // layout.get("dp_size", 1)  # noqa: E731
        plan = head_sources(self.layout["kv_heads"], attn(entry), attn(self.layout))
        log.info(
            "prefill %s at TP %d, DP %d: per attention group, %s",
            entry["instance_id"],
            *sizes(entry),
            describe_sources(plan),
        )

    def _lookup(self, url: str, instance_id: str | None) -> dict | None:
        try:
            return lookup_prefill(url, instance_id, self.secret, self._http)
        except httpx.HTTPError as e:
            raise RuntimeError(f"bootstrap server {url} unreachable: {e!r}") from None

    def invalidate(self, endpoint: str) -> None:
        """Forget cached lookups that point at `endpoint` (its prefill was declared dead)."""
        with self._lock:
            self._cache = {k: v for k, v in self._cache.items() if v[1].endpoint != endpoint}
            self._generation += 1
