"""Which peers have shown a sign of life lately. Decode pings every prefill it waits on and counts
the pongs; prefill counts those pings. A peer silent for `misses` heartbeat intervals is declared
dead and its rooms fail. The heartbeat rides our own control plane, so it also catches a frozen
process (SIGSTOP) whose sockets stay open, which no TCP error would reveal."""
from __future__ import annotations

import threading
import time


class Liveness:
    def __init__(self, interval_s: float, misses: int):
        self.window_s = interval_s * misses
        self._last_seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def seen(self, peer: str) -> None:
        with self._lock:
            self._last_seen[peer] = time.monotonic()

    def silent(self, watched: set[str]) -> list[tuple[str, float]]:
        """(peer, seconds silent) for each watched peer silent longer than the window. A peer watched
        for the first time starts its clock now; peers no longer watched are forgotten, so a later
        room with them starts a fresh clock."""
        now = time.monotonic()
        with self._lock:
            for peer in list(self._last_seen):
                if peer not in watched:
                    del self._last_seen[peer]
            ages = [(p, now - self._last_seen.setdefault(p, now)) for p in watched]
        return [(p, age) for p, age in ages if age > self.window_s]
