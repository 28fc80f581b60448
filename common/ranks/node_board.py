"""What the nodes of a TP group spanning machines (--nnodes > 1) tell each other, through the group's own
rendezvous store (torch.distributed's TCPStore at --dist-init-addr, which rank 0 serves): no other port.

    tandem/node/<k>   node k's heartbeat: {"beat": n, "serving": bool, "ranks": {rank: [pid, state,
                      progress]}}, rewritten every --heartbeat-interval-s (progress as in
                      common.ranks.progress; node 0's "serving": its start-up is over)
    tandem/fault      the first fault of the group, in words naming the rank or node; every node that
                      reads it ends its ranks
    tandem/config     node 0's config (secrets left out), posted before any rank starts: every node's
                      ranks run with it (common.ranks.node)

A rendezvous-store call to a stopped node may block for good (a TCPStore get does not honour its timeout when
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


def node_key(node: int) -> str:
    return f"tandem/node/{node}"


class NodeBoard:
    """Node `node`'s side of the board, over the rendezvous store (rank 0's, common.parallel.group.serve_rendezvous/join_rendezvous)."""

    def __init__(self, rendezvous: dist.TCPStore, node: int):
        self.rendezvous, self.node, self.beat = rendezvous, node, 0

    def publish(self, ranks: RankState, serving: bool = False) -> None:
        """This node's heartbeat with its ranks' pids, states and progress."""
        self.beat += 1
        body = {"beat": self.beat, "serving": serving, "ranks": {str(r): list(v) for r, v in ranks.items()}}
        self.rendezvous.set(node_key(self.node), json.dumps(body))

    def read(self, node: int) -> Beat | None:
        """Node `node`'s last heartbeat, None before its first."""
        if not self.rendezvous.check([node_key(node)]):
            return None
        body = json.loads(self.rendezvous.get(node_key(node)))
        return Beat(body["beat"], body["serving"], {int(r): tuple(v) for r, v in body["ranks"].items()})

    def fault(self) -> str | None:
        if not self.rendezvous.check([FAULT_KEY]):
            return None
        return self.rendezvous.get(FAULT_KEY).decode()

    def set_fault(self, message: str) -> None:
        """Post `message` as the group's fault unless one is posted already (the first one stays)."""
        self.rendezvous.compare_set(FAULT_KEY, "", message)

    def post_config(self, config: ServerConfig) -> None:
        """Node 0's config for the other nodes' ranks, without its secrets (the rendezvous store is unauthenticated)."""
        self.rendezvous.set(CONFIG_KEY, config.model_dump_json(exclude={"api_key", "cluster_secret"}))

    def config(self) -> dict:
        """Node 0's config, waiting for it to be posted."""
        return json.loads(self.rendezvous.get(CONFIG_KEY))
