"""What the hosts of a TP group spanning machines (--nnodes > 1) tell each other, through the group's own
rendezvous store (torch.distributed's TCPStore at --dist-init-addr, which rank 0 hosts): no other port.

    tandem/host/<k>   host k's heartbeat: {"beat": n, "serving": bool, "ranks": {rank: [pid, state,
                      progress]}}, rewritten every --heartbeat-interval-s (progress as in
                      common.ranks.progress; host 0's "serving": its start-up is over)
    tandem/fault      the first fault of the group, in words naming the rank or host; every host that
                      reads it ends its ranks
    tandem/config     host 0's config (secrets left out), posted before any rank starts: every host's
                      ranks run with it (common.ranks.host)

A store call to a stopped host may block for good (a TCPStore get does not honour its timeout when
the server is frozen), so callers judge a peer by when they last heard from it, not by a call failing.
"""

from __future__ import annotations

import json
import logging
from typing import NamedTuple

import torch.distributed as dist

from common.config import ServerConfig

log = logging.getLogger(__name__)
FAULT_KEY = "tandem/fault"
CONFIG_KEY = "tandem/config"
RankState = dict[int, tuple[int, str, int]]  # rank -> (pid, state letter, progress value)


class Beat(NamedTuple):
    number: int
    serving: bool
    ranks: RankState


def host_key(host: int) -> str:
    return f"tandem/host/{host}"


class HostBoard:
    """Host `host`'s side of the board, over `store` (rank 0's, common.parallel.group.host_store/join_store)."""

    def __init__(self, store: dist.TCPStore, host: int):
        self.store, self.host, self.beat = store, host, 0

    def publish(self, ranks: RankState, serving: bool = False) -> None:
        """This host's heartbeat with its ranks' pids, states and progress."""
        self.beat += 1
        body = {"beat": self.beat, "serving": serving, "ranks": {str(r): list(v) for r, v in ranks.items()}}
        self.store.set(host_key(self.host), json.dumps(body))

    def read(self, host: int) -> Beat | None:
        """Host `host`'s last heartbeat, None before its first."""
        if not self.store.check([host_key(host)]):
            return None
        body = json.loads(self.store.get(host_key(host)))
        return Beat(body["beat"], body["serving"], {int(r): tuple(v) for r, v in body["ranks"].items()})

    def fault(self) -> str | None:
        if not self.store.check([FAULT_KEY]):
            return None
        return self.store.get(FAULT_KEY).decode()

    def set_fault(self, message: str) -> None:
        """Post `message` as the group's fault unless one is posted already (the first one stays)."""
        self.store.compare_set(FAULT_KEY, "", message)

    def post_config(self, config: ServerConfig) -> None:
        """Host 0's config for the other hosts' ranks, without its secrets (the store is unauthenticated)."""
        self.store.set(CONFIG_KEY, config.model_dump_json(exclude={"api_key", "cluster_secret"}))

    def config(self) -> dict:
        """Host 0's config, waiting for it to be posted."""
        return json.loads(self.store.get(CONFIG_KEY))
