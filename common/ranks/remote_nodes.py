"""Rank 0's view of the TP group's other nodes (--nnodes > 1), through the node board
(common.ranks.node_board): rank 0 cannot poll a process or read a progress file on another node.

Rank 0 posts node 0's heartbeat every --heartbeat-interval-s (a node k whose node 0 falls silent once
serving ends its ranks; during start-up loading and the group's set-up may hold Python's lock for
long) and reads every other node's. A node is at fault when
- the board holds a fault: node k posts one when one of its ranks exits (naming the rank, its pid and
  exit code), and any node's reader ends its ranks on it;
- its heartbeat has not changed for --heartbeat-interval-s x --heartbeat-misses: its process died or
  hangs (its ranks exit when it dies: their stdin closes). The fault names the node and its ranks.
A rank that hangs while its node's process lives is named by rank 0's step watchdog: each heartbeat
carries the node's ranks' progress, copied into rank 0's progress file.
"""

from __future__ import annotations

import time

from common.config import ServerConfig
from common.ranks.node_board import NodeBoard, RankState
from common.ranks.progress import Progress


class RemoteNodes:
    def __init__(self, config: ServerConfig, board: NodeBoard):
        self.board, self.nnodes, self.per_node = board, config.nnodes, config.ranks_per_node
        self.interval_s = config.heartbeat_interval_s
        self.window_s = config.heartbeat_interval_s * config.heartbeat_misses
        self.heard: dict[int, tuple[int, float]] = {}  # node -> (its last beat, when that beat arrived)
        self.serving_since: float | None = None  # when every node had loaded: silences count from then on
        self.ranks: RankState = {}
        self.next_beat = 0.0

    def poll(self, serving: bool, progress: Progress) -> str | None:
        """Post node 0's heartbeat when due and read the others'; the group's fault, or None."""
        now = time.monotonic()
        if now >= self.next_beat:
            self.board.publish({}, serving)
            self.next_beat = now + self.interval_s
        fault = self.board.fault()
        if fault is not None:
            return fault
        return next(filter(None, (self._check(node, now, serving, progress) for node in range(1, self.nnodes))), None)

    def _check(self, node: int, now: float, serving: bool, progress: Progress) -> str | None:
        """Node `node`'s silence, if too long once serving, counted from then at the earliest: loading a
        large model's shard takes minutes, and a node's process may be starved meanwhile (during start-up a
        node's death shows as the group's set-up or a collective failing on rank 0, which ends the server)."""
        seen = self.board.read(node)
        if seen is not None:
            if self.heard.get(node, (None,))[0] != seen.number:
                self.heard[node] = (seen.number, now)
            self.ranks.update(seen.ranks)
            for rank, (_, _, value) in seen.ranks.items():
                progress.values[rank] = value
        if not serving:
            return None
        if self.serving_since is None:  # a beat that came before every node loaded is not held against it
            self.serving_since = now
        silent = now - max(self.heard.setdefault(node, (0, now))[1], self.serving_since)
        if silent <= self.window_s:
            return None
        first = node * self.per_node
        ranks = f"tp rank {first}" if self.per_node == 1 else f"tp ranks {first}-{first + self.per_node - 1}"
        return (
            f"node {node} ({ranks}) has sent no heartbeat for {silent:.1f} s (over --heartbeat-interval-s x "
            f"--heartbeat-misses = {self.window_s:g} s): its process died or hangs"
        )

    def describe(self, rank: int) -> str:
        """A remote rank as its node last described it: pid, node and process state."""
        pid, state, _ = self.ranks.get(rank, ("?", "?", 0))
        return f"pid {pid} on node {rank // self.per_node}, state {state}"
