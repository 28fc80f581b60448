"""Node k > 0 of a TP group spanning nodes (`tandem serve --nnodes N --node-rank k --dist-init-addr
HOST:PORT`): no HTTP and no model of its own. It waits for node 0's rendezvous store, starts this node's ranks
(followers of rank 0, which node 0 runs) with node 0's config (`node0_config`: this node keeps only its
own place, model path and addresses), posts their state on the node board every
--heartbeat-interval-s, and exits when they are done:
- rank 0 stops them (after its drain): they exit 0, and so does this process;
- one of them exits otherwise: the fault is posted naming the rank (unless a collective failed in it,
  PEER_GONE_EXIT: another rank is gone, and rank 0 names that one), the others are killed, exit 1;
- a fault posted by any node, node 0's heartbeat unchanged for --heartbeat-interval-s x
  --heartbeat-misses once node 0 serves (it hangs), or node 0's rendezvous store gone (rank 0 exited, at any
  time: a frozen node 0 during its start-up is not caught): the ranks get one second
  to finish a stop on their own, then are killed; exit 1 unless they all stopped cleanly.
SIGTERM or SIGINT: the ranks run on until rank 0 stops them (node 0 drains), for at most
--drain-timeout-s + 15 s. When this process is killed, its ranks' stdin closes and they exit; node 0
sees the heartbeat stop.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from pydantic import ValidationError

from common.config import ServerConfig
from common.parallel.group import PEER_GONE_EXIT, join_rendezvous
from common.ranks.launch import end_followers, kill, local_ranks, spawn_followers, state_of
from common.ranks.node_board import NodeBoard
from common.ranks.progress import Progress
from common.ranks.ranks import GROUP_TIMEOUT_S, POLL_S
from common.wire.user_error import config_error

log = logging.getLogger(__name__)
STOP_GRACE_S = 1.0


# what a node keeps of its own config: its place, model path, addresses and secrets (the rest is node 0's)
OWN_FIELDS = frozenset(
    {"node_rank", "model", "host", "port", "advertise_host", "dist_init_addr", "drain_timeout_s", "kernel_cache_dir"}
    | {"api_key", "cluster_secret", "ssl_certfile", "ssl_keyfile", "ssl_ca_certs"}
)


def node0_config(own: ServerConfig, posted: dict) -> ServerConfig:
    """The config this node's ranks run with: node 0's `posted` one, but for this node's own fields
    (OWN_FIELDS: its --node-rank, its --model path, its addresses); a flag of its own that differs from
    node 0's is logged and overridden, so no rank of the group runs with another's sizes."""
    mine = own.model_dump(mode="json")
    merged = {k: v for k, v in posted.items() if k not in OWN_FIELDS} | {k: mine[k] for k in OWN_FIELDS}
    for k in sorted(k for k, v in merged.items() if v != mine[k]):
        log.warning("--%s %s on this node: node 0's %s is used", k.replace("_", "-"), mine[k], merged[k])
    try:
        return ServerConfig.model_validate(merged)
    except ValidationError as e:
        raise config_error(e) from None


class Node:
    def __init__(self, config: ServerConfig, board: NodeBoard, follower: str):
        """`follower`: the module each rank runs (common.ranks.launch)."""
        self.config, self.addr, self.board = config, config.dist_init_addr, board
        self.window_s = config.heartbeat_interval_s * config.heartbeat_misses
        self.progress = Progress.create(config.tp_size)
        ranks = list(local_ranks(config))
        self.procs = dict(zip(ranks, spawn_followers(config, self.addr, self.progress.path, follower)))
        self.problem: str | None = None  # found by the heartbeat thread
        self.node0: tuple[int, float] | None = None  # node 0's last beat since it serves, and when it arrived
        self.deadline: float | None = None  # set by SIGTERM / SIGINT
        log.info("node %d: tp ranks %s (pids %s), group at %s", config.node_rank, ranks, self.pids(), self.addr)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def run(self) -> int:
        """Until the ranks are done; the exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        threading.Thread(target=self._heartbeat, name="node-heartbeat", daemon=True).start()
        while True:
            code = self._ranks_done()
            if code is not None:
                return code
            reason = self.problem or self._node0_silence() or self._past_deadline()
            if reason is not None:
                return self._end(reason)
            time.sleep(POLL_S)

    def _ranks_done(self) -> int | None:
        """0 when every rank exited cleanly, 1 after one failed (posted, the others killed), else None."""
        node = self.config.node_rank
        for rank, p in self.procs.items():
            if p.poll() not in (None, 0):
                message = f"tp rank {rank} (pid {p.pid} on node {node}) exited with code {p.returncode}"
                if p.returncode != PEER_GONE_EXIT:  # else a consequence: rank 0 names the rank that is gone
                    self._post(message)
                return self._end(message)
        return 0 if all(p.poll() == 0 for p in self.procs.values()) else None

    def _end(self, reason: str) -> int:
        log.error("ending tp ranks %s: %s", list(self.procs), reason)
        end_followers(list(self.procs.values()), STOP_GRACE_S)
        return 0 if all(p.returncode == 0 for p in self.procs.values()) else 1

    def _post(self, message: str) -> None:
        """Post a fault for every node to see, waiting at most a second (a frozen node 0 never answers)."""
        t = threading.Thread(target=self.board.set_fault, args=(message,), name="node-fault", daemon=True)
        t.start()
        t.join(1.0)

    def _heartbeat(self) -> None:
        """Post this node's heartbeat and read node 0's every interval."""
        try:
            while True:
                self.board.publish(
                    {r: (p.pid, state_of(p.pid), int(self.progress.values[r])) for r, p in self.procs.items()}
                )
                self._read_node0()
                time.sleep(self.config.heartbeat_interval_s)
        except Exception as e:  # the rendezvous store's connection closed: rank 0's process is gone
            self.problem = f"node 0's rendezvous store at {self.addr} is gone (rank 0 exited): {str(e).splitlines()[0]}"

    def _read_node0(self) -> None:
        fault = self.board.fault()
        if fault is not None:
            self.problem = f"the TP group is broken: {fault}"
        seen = self.board.read(0)
        if seen is not None and seen.serving and (self.node0 is None or self.node0[0] != seen.number):
            self.node0 = (seen.number, time.monotonic())

    def _node0_silence(self) -> str | None:
        silent = time.monotonic() - self.node0[1] if self.node0 is not None else 0.0
        if silent <= self.window_s:
            return None
        return (
            f"node 0 has sent no heartbeat for {silent:.1f} s (over --heartbeat-interval-s x --heartbeat-misses "
            f"= {self.window_s:g} s): it hangs"
        )

    def _on_signal(self, signum: int, _frame) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.config.drain_timeout_s + 15.0
            log.info("%s: the ranks run on until node 0 stops them", signal.Signals(signum).name)

    def _past_deadline(self) -> str | None:
        if self.deadline is None or time.monotonic() < self.deadline:
            return None
        return "node 0 did not stop the ranks within --drain-timeout-s + 15 s of this node's SIGTERM"


def run_node(own: ServerConfig, follower: str) -> None:
    """Wait for node 0's rendezvous store (node 0 may start later), run this node's ranks (each `python -m follower`) with
    node 0's config, exit."""
    addr, k = own.dist_init_addr, own.node_rank
    waiting = f"node {k}: waiting for node 0's rendezvous at {addr} (up to --dist-timeout {own.dist_timeout:g} s)"
    board = NodeBoard(join_rendezvous(addr, GROUP_TIMEOUT_S, own.dist_timeout, waiting), k)
    node = Node(node0_config(own, board.config()), board, follower)
    try:
        code = node.run()
    finally:
        for p in node.procs.values():
            kill(p)
        node.progress.remove()
    logging.shutdown()
    os._exit(code)  # not through interpreter teardown: the heartbeat thread may block in a rendezvous-store call
