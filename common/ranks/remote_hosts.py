"""Rank 0's view of the TP group's other hosts (--nnodes > 1), through the host board
(common.ranks.host_board): rank 0 cannot poll a process or read a progress file on another host.

Rank 0 posts host 0's heartbeat every --heartbeat-interval-s (a host k whose host 0 falls silent once
serving ends its ranks; during start-up loading and the group's set-up may hold Python's lock for
long) and reads every other host's. A host is at fault when
- the board holds a fault: host k posts one when one of its ranks exits (naming the rank, its pid and
  exit code), and any host's reader ends its ranks on it;
- its heartbeat has not changed for --heartbeat-interval-s x --heartbeat-misses: its process died or
  hangs (its ranks exit when it dies: their stdin closes). The fault names the host and its ranks.
A rank that hangs while its host's process lives is named by rank 0's step watchdog: each heartbeat
carries the host's ranks' progress, copied into rank 0's progress file.
"""

from __future__ import annotations

import time

from common.config import ServerConfig
from common.ranks.host_board import HostBoard, RankState
from common.ranks.progress import Progress


class RemoteHosts:
    def __init__(self, config: ServerConfig, board: HostBoard):
        self.board, self.nnodes, self.per_host = board, config.nnodes, config.ranks_per_host
        self.interval_s = config.heartbeat_interval_s
        self.window_s = config.heartbeat_interval_s * config.heartbeat_misses
        self.heard: dict[int, tuple[int, float]] = {}  # host -> (its last beat, when that beat arrived)
        self.ranks: RankState = {}
        self.next_beat = 0.0

    def poll(self, serving: bool, progress: Progress) -> str | None:
        """Post host 0's heartbeat when due and read the others'; the group's fault, or None."""
        now = time.monotonic()
        if now >= self.next_beat:
            self.board.publish({}, serving)
            self.next_beat = now + self.interval_s
        fault = self.board.fault()
        if fault is not None:
            return fault
        return next(filter(None, (self._check(host, now, serving, progress) for host in range(1, self.nnodes))), None)

    def _check(self, host: int, now: float, serving: bool, progress: Progress) -> str | None:
        """Host `host`'s silence, if too long once serving (during start-up a host's death shows as the
        group's set-up or a collective failing on rank 0, which ends the server)."""
        seen = self.board.read(host)
        if seen is not None:
            if self.heard.get(host, (None,))[0] != seen.number:
                self.heard[host] = (seen.number, now)
            self.ranks.update(seen.ranks)
            for rank, (_, _, value) in seen.ranks.items():
                progress.values[rank] = value
        if not serving:
            return None
        silent = now - self.heard.setdefault(host, (0, now))[1]
        if silent <= self.window_s:
            return None
        first = host * self.per_host
        ranks = f"tp rank {first}" if self.per_host == 1 else f"tp ranks {first}-{first + self.per_host - 1}"
        return (
            f"host {host} ({ranks}) has sent no heartbeat for {silent:.1f} s (over --heartbeat-interval-s x "
            f"--heartbeat-misses = {self.window_s:g} s): its process died or hangs"
        )

    def describe(self, rank: int) -> str:
        """A remote rank as its host last described it: pid, host and process state."""
        pid, state, _ = self.ranks.get(rank, ("?", "?", 0))
        return f"pid {pid} on host {rank // self.per_host}, state {state}"
