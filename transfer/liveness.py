"""Which peers have shown a sign of life lately, and whether a prefill may still write into a decode.

Decode pings every prefill it waits on (every half heartbeat interval) and counts the pongs; prefill
counts those pings. A peer silent for `misses` heartbeat intervals is declared dead and its rooms fail.
The heartbeat rides our own control plane, so it also catches a frozen process (SIGSTOP) whose sockets
stay open, which no TCP error would reveal.

The write fence: a prefill writes into a decode only while that decode's freshest message was *sent*
(the signed envelope's wall-clock time) less than one heartbeat interval ago. A decode stops pinging a
prefill it declared dead and reuses that prefill's pages one interval (plus CLOCK_SLACK_S) later, so a
prefill that was frozen and wakes up finds only stale pings in its socket and writes nothing: see
docs/faults.md for what this does not cover.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOCK_SLACK_S = 1.0  # how far apart the wall clocks of two hosts may be for the fence to hold


class Liveness:
    def __init__(
        self,
        interval_s: float,
        misses: int,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.interval_s = interval_s
        self.window_s = interval_s * misses
        self.clock, self.wall_clock = clock, wall_clock
        self._last_seen: dict[str, float] = {}  # our monotonic clock when we last heard from the peer
        self._last_sent: dict[str, float] = {}  # the peer's wall clock when it sent its freshest message
        self._lock = threading.Lock()

    def seen(self, peer: str, sent_at: float | None = None) -> None:
        with self._lock:
            self._last_seen[peer] = self.clock()
            if sent_at is not None and sent_at > self._last_sent.get(peer, float("-inf")):
                self._last_sent[peer] = sent_at

    def silent(self, watched: list[str]) -> list[tuple[str, float]]:
        """(peer, seconds silent) for each watched peer silent longer than the window. A peer watched
        for the first time starts its clock now; peers no longer watched are forgotten, so a later
        room with them starts a fresh clock."""
        now = self.clock()
        with self._lock:
            for peer in list(self._last_seen):
                if peer not in watched:
                    del self._last_seen[peer]
            ages = [(p, now - self._last_seen.setdefault(p, now)) for p in watched]
        return [(p, age) for p, age in ages if age > self.window_s]

    def may_write_to(self, peer: str) -> str | None:
        """None if `peer` sent a message within one heartbeat interval; else why writing is fenced."""
        with self._lock:
            sent = self._last_sent.get(peer)
        if sent is None:
            return f"decode {peer} never sent a signed message"
        age = self.wall_clock() - sent
        if age > self.interval_s:
            return (
                f"decode {peer} has sent nothing for {age:.1f} s (this process was frozen, or the decode gave up on it)"
            )
        return None

    def forget(self, peer: str) -> None:
        with self._lock:
            self._last_seen.pop(peer, None)
            self._last_sent.pop(peer, None)
