"""Where is the prefill of a request? Bootstrap lookups, cached briefly, with the layout checked."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx

from bootstrap.client import lookup_prefill
from common.wire.api import Pairing
from common.wire.kv_layout import layout_mismatch

CACHE_TTL_S = 2.0
REGISTER_WAIT_S = 30.0
INSTANCE_WAIT_S = 2.0


@dataclass(frozen=True)
class Peer:
    endpoint: str
    instance_id: str


class PeerDirectory:
    def __init__(self, layout: dict, secret: str | None):
        self.layout = layout
        self.secret = secret
        self._cache: dict[tuple[str | None, int | None, str | None], tuple[float, Peer]] = {}
        self._lock = threading.Lock()

    def lookup(self, pairing: Pairing) -> Peer:
        """Blocking (runs on a worker thread); waits a while for a prefill that has not registered yet."""
        key = (pairing.bootstrap_host, pairing.bootstrap_port, pairing.prefill_instance_id)
        with self._lock:
            hit = self._cache.get(key)
        if hit and time.monotonic() - hit[0] < CACHE_TTL_S:
            return hit[1]
        url = f"http://{pairing.bootstrap_host}:{pairing.bootstrap_port}"
        # a named instance was healthy when the router picked it: if it is gone, it is not coming back
        deadline = time.monotonic() + (INSTANCE_WAIT_S if pairing.prefill_instance_id else REGISTER_WAIT_S)
        while (entry := self._lookup(url, pairing.prefill_instance_id)) is None:
            if time.monotonic() > deadline:
                what = f"prefill {pairing.prefill_instance_id}" if pairing.prefill_instance_id else "no prefill rank"
                raise RuntimeError(f"{what} registered at bootstrap {url} within {REGISTER_WAIT_S:.0f} s")
            time.sleep(0.2)
        mismatch = layout_mismatch(self.layout, entry)
        if mismatch:
            raise RuntimeError(f"refusing prefill at {url}: {mismatch}")
        peer = Peer(f"tcp://{entry['rank_ip']}:{entry['rank_port']}", entry["instance_id"])
        with self._lock:
            self._cache[key] = (time.monotonic(), peer)
        return peer

    def _lookup(self, url: str, instance_id: str | None) -> dict | None:
        try:
            return lookup_prefill(url, instance_id, self.secret)
        except httpx.HTTPError as e:
            raise RuntimeError(f"bootstrap server {url} unreachable: {e!r}") from None

    def invalidate(self, endpoint: str) -> None:
        """Forget cached lookups that point at `endpoint` (its prefill was declared dead)."""
        with self._lock:
            self._cache = {k: v for k, v in self._cache.items() if v[1].endpoint != endpoint}
