"""Host k > 0 of a TP group spanning hosts (`tandem serve --nnodes N --node-rank k --dist-init-addr
HOST:PORT`): no HTTP and no model of its own. It waits for host 0's store, starts this host's ranks
(followers of rank 0, which host 0 runs) with host 0's config (`host0_config`: this host keeps only its
own place, model path and addresses), posts their state on the host board every
--heartbeat-interval-s, and exits when they are done:
- rank 0 stops them (after its drain): they exit 0, and so does this process;
- one of them exits otherwise: the fault is posted naming the rank (unless a collective failed in it,
  PEER_GONE_EXIT: another rank is gone, and rank 0 names that one), the others are killed, exit 1;
- a fault posted by any host, host 0's heartbeat unchanged for --heartbeat-interval-s x
  --heartbeat-misses once host 0 serves (it hangs), or host 0's store gone (rank 0 exited, at any
  time: a frozen host 0 during its start-up is not caught): the ranks get one second
  to finish a stop on their own, then are killed; exit 1 unless they all stopped cleanly.
SIGTERM or SIGINT: the ranks run on until rank 0 stops them (host 0 drains), for at most
--drain-timeout-s + 15 s. When this process is killed, its ranks' stdin closes and they exit; host 0
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
from common.parallel.group import PEER_GONE_EXIT, join_store
from common.ranks.host_board import HostBoard
from common.ranks.launch import end_followers, kill, local_ranks, spawn_followers, state_of
from common.ranks.progress import Progress
from common.ranks.ranks import GROUP_TIMEOUT_S, POLL_S
from common.wire.user_error import config_error

log = logging.getLogger(__name__)
STOP_GRACE_S = 1.0


# what a host keeps of its own config: its place, model path, addresses and secrets (the rest is host 0's)
OWN_FIELDS = frozenset(
    {"node_rank", "model", "host", "port", "advertise_host", "dist_init_addr", "drain_timeout_s", "kernel_cache_dir"}
    | {"api_key", "cluster_secret", "ssl_certfile", "ssl_keyfile", "ssl_ca_certs"}
)


def host0_config(own: ServerConfig, posted: dict) -> ServerConfig:
    """The config this host's ranks run with: host 0's `posted` one, but for this host's own fields
    (OWN_FIELDS: its --node-rank, its --model path, its addresses); a flag of its own that differs from
    host 0's is logged and overridden, so no rank of the group runs with another's sizes."""
    mine = own.model_dump(mode="json")
    merged = {k: v for k, v in posted.items() if k not in OWN_FIELDS} | {k: mine[k] for k in OWN_FIELDS}
    for k in sorted(k for k, v in merged.items() if v != mine[k]):
        log.warning("--%s %s on this host: host 0's %s is used", k.replace("_", "-"), mine[k], merged[k])
    try:
        return ServerConfig.model_validate(merged)
    except ValidationError as e:
        raise config_error(e) from None


class Host:
    def __init__(self, config: ServerConfig, board: HostBoard, follower: str):
        """`follower`: the module each rank runs (common.ranks.launch)."""
        self.config, self.addr, self.board = config, config.dist_init_addr, board
        self.window_s = config.heartbeat_interval_s * config.heartbeat_misses
        self.progress = Progress.create(config.tp_size)
        ranks = list(local_ranks(config))
        self.procs = dict(zip(ranks, spawn_followers(config, self.addr, self.progress.path, follower)))
        self.problem: str | None = None  # found by the heartbeat thread
        self.host0: tuple[int, float] | None = None  # host 0's last beat since it serves, and when it arrived
        self.deadline: float | None = None  # set by SIGTERM / SIGINT
        log.info("host %d: tp ranks %s (pids %s), group at %s", config.node_rank, ranks, self.pids(), self.addr)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def run(self) -> int:
        """Until the ranks are done; the exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        threading.Thread(target=self._heartbeat, name="host-heartbeat", daemon=True).start()
        while True:
            code = self._ranks_done()
            if code is not None:
                return code
            reason = self.problem or self._host0_silence() or self._past_deadline()
            if reason is not None:
                return self._end(reason)
            time.sleep(POLL_S)

    def _ranks_done(self) -> int | None:
        """0 when every rank exited cleanly, 1 after one failed (posted, the others killed), else None."""
        host = self.config.node_rank
        for rank, p in self.procs.items():
            if p.poll() not in (None, 0):
                message = f"tp rank {rank} (pid {p.pid} on host {host}) exited with code {p.returncode}"
                if p.returncode != PEER_GONE_EXIT:  # else a consequence: rank 0 names the rank that is gone
                    self._post(message)
                return self._end(message)
        return 0 if all(p.poll() == 0 for p in self.procs.values()) else None

    def _end(self, reason: str) -> int:
        log.error("ending tp ranks %s: %s", list(self.procs), reason)
        end_followers(list(self.procs.values()), STOP_GRACE_S)
        return 0 if all(p.returncode == 0 for p in self.procs.values()) else 1

    def _post(self, message: str) -> None:
        """Post a fault for every host to see, waiting at most a second (a frozen host 0 never answers)."""
        t = threading.Thread(target=self.board.set_fault, args=(message,), name="host-fault", daemon=True)
        t.start()
        t.join(1.0)

    def _heartbeat(self) -> None:
        """Post this host's heartbeat and read host 0's every interval."""
        try:
            while True:
                self.board.publish(
                    {r: (p.pid, state_of(p.pid), int(self.progress.values[r])) for r, p in self.procs.items()}
                )
                self._read_host0()
                time.sleep(self.config.heartbeat_interval_s)
        except Exception as e:  # the store's connection closed: rank 0's process is gone
            self.problem = f"host 0's store at {self.addr} is gone (rank 0 exited): {str(e).splitlines()[0]}"

    def _read_host0(self) -> None:
        fault = self.board.fault()
        if fault is not None:
            self.problem = f"the TP group is broken: {fault}"
        seen = self.board.read(0)
        if seen is not None and seen.serving and (self.host0 is None or self.host0[0] != seen.number):
            self.host0 = (seen.number, time.monotonic())

    def _host0_silence(self) -> str | None:
        silent = time.monotonic() - self.host0[1] if self.host0 is not None else 0.0
        if silent <= self.window_s:
            return None
        return (
            f"host 0 has sent no heartbeat for {silent:.1f} s (over --heartbeat-interval-s x --heartbeat-misses "
            f"= {self.window_s:g} s): it hangs"
        )

    def _on_signal(self, signum: int, _frame) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.config.drain_timeout_s + 15.0
            log.info("%s: the ranks run on until host 0 stops them", signal.Signals(signum).name)

    def _past_deadline(self) -> str | None:
        if self.deadline is None or time.monotonic() < self.deadline:
            return None
        return "host 0 did not stop the ranks within --drain-timeout-s + 15 s of this host's SIGTERM"


def run_host(own: ServerConfig, follower: str) -> None:
    """Wait for host 0's store (host 0 may start later), run this host's ranks (each `python -m follower`) with
    host 0's config, exit."""
    board = HostBoard(join_store(own.dist_init_addr, GROUP_TIMEOUT_S), own.node_rank)
    host = Host(host0_config(own, board.config()), board, follower)
    try:
        code = host.run()
    finally:
        for p in host.procs.values():
            kill(p)
        host.progress.remove()
    logging.shutdown()
    os._exit(code)  # not through interpreter teardown: the heartbeat thread may block in a store call
