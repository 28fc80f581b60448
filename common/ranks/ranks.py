"""Rank 0's side of tensor parallelism: it starts this node's followers, serves the group's rendezvous and joins it,
sends every forward to all ranks before running its own share (`forward`), watches them, and stops them.

Faults: a follower that exits, or that has not finished a step within --watchdog-timeout-s, is a fault
of the whole group: it is named (`fault`, what /health answers with 503), the other followers are killed
(which ends a gloo collective rank 0 waits in; on CUDA the NCCL communicators are aborted, which ends the
collectives rank 0's stream spins in: common.parallel.group), the step's requests fail with a RankFault
naming the rank (`check_step`, after the step's tokens reached the host: an aborted step read garbage),
and so does every later forward. A follower that exits because a collective failed
(PEER_GONE_EXIT) is not blamed unless no other rank is named within `grace_s`. A follower that exits
during start-up ends the server. With
--nnodes > 1 the ranks of other nodes are watched through the node board (common.ranks.remote_nodes),
and a fault is posted there so that every node ends its ranks.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from common.config import ServerConfig
from common.core.forward_batch import ForwardBatch
from common.parallel.group import (
    PEER_GONE_EXIT,
    TensorParallel,
    abort_collectives,
    init_group,
    serve_rendezvous,
    start_barrier,
)
from common.ranks.launch import end_followers, group_addr, kill, spawn_followers, state_of
from common.ranks.node_board import NodeBoard
from common.ranks.progress import Progress
from common.ranks.rank_model import model_layout
from common.ranks.remote_nodes import RemoteNodes
from common.ranks.step import StepChannel

log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_S = 0.1
GROUP_TIMEOUT_S = 365 * 24 * 3600.0  # followers wait for the next step as long as the server idles
STOP_GRACE_S = 10.0


def rank_name(tp: TensorParallel, rank: int) -> str:
    """How faults name a rank: its DP rank too under DP attention (each holds its own requests)."""
    return f"dp rank {rank} (tp rank {rank})" if tp.dp_attention else f"tp rank {rank}"


class RankFault(RuntimeError):
    """A rank of the TP group died or hangs; the message names it."""


class Ranks:
    def __init__(self, config: ServerConfig, follower: str):
        """`follower`: the module each follower runs (common.ranks.launch)."""
        self.config = config
        self.progress = Progress.create(config.tp_size)
        addr = group_addr(config)
        rendezvous = serve_rendezvous(addr, config.tp_size, GROUP_TIMEOUT_S)
        self.procs: list[subprocess.Popen] = spawn_followers(config, addr, self.progress.path, follower)
        self.remote = RemoteNodes(config, NodeBoard(rendezvous, 0)) if config.nnodes > 1 else None
        if self.remote is not None:  # the other nodes' ranks run with it (common.ranks.node)
            self.remote.board.post_config(config)
        self.fault: str | None = None
        self.serving = self.stopping = False
        self.step, self.step_started = 0, None
        self._lock = threading.Lock()
        # how long a failed collective waits for the name of the rank that is gone (a node's silence on
        # another node), and a follower here that exited because of it is not blamed
        self.grace_s = 2.0 + (self.remote.window_s if self.remote else 0.0)
        self._lost: dict[int, float] = {}  # follower -> when it was seen exited with PEER_GONE_EXIT
        threading.Thread(target=self._watch, name="tp-ranks", daemon=True).start()
        per_node = config.ranks_per_node
        start_barrier(rendezvous, 0, config.tp_size, config.dist_timeout, per_node)  # a missing node: one clear line
        group = init_group(0, config.tp_size, rendezvous, config.device, GROUP_TIMEOUT_S, per_node)
        self.tp: TensorParallel = model_layout(group, config)
        self.channel = StepChannel(self.tp, config.device, config.page_size)

    def forward(self, batches: list[ForwardBatch], run: Callable[[], T]) -> T:
        """Send the step's batches to the followers (one, or one per rank under DP attention), then `run()`
        rank 0's share of it."""
        return self._step(lambda: self.channel.send(batches, self.step), run)

    def group_op(self, op: int, run: Callable[[], T]) -> T:
        """Tell every follower to run the group operation `op` (common.ranks.step), then `run()` rank 0's part."""
        return self._step(lambda: self.channel.send_op(op, self.step), run)

    def _step(self, send: Callable[[], None], run: Callable[[], T]) -> T:
        if self.fault is not None:
            raise RankFault(self.fault)
        self.step += 1
        self.progress.started(self.step)
        self.step_started = time.monotonic()
        try:
            send()
            return run()
        except Exception as e:
            raise RankFault(self._diagnose(e)) from e
        finally:
            self.step_started = None

    def check_step(self) -> None:
        """After a step's results reached the host: raise if the group faulted meanwhile (on CUDA the
        step may have ended only because its collectives were aborted)."""
        if self.fault is not None:
            raise RankFault(self.fault)

    def _diagnose(self, error: Exception) -> str:
        """Why the step failed: a follower that exited (waited for: its collective may end first; on
        another node, up to the heartbeat window: its node's process may have died with it)."""
        deadline = time.monotonic() + self.grace_s
        while self.fault is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self._set_fault(f"a collective of the TP group failed on rank 0: {error!r}")
        return self.fault

    def _watch(self) -> None:
        while not self.stopping:
            problem = self.remote.poll(self.serving, self.progress) if self.remote else None
            if problem is not None:  # first: a follower here may have exited because of it
                self._on_remote(problem)
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None and not self.stopping:
                    self._on_exit(rank, p)
            started = self.step_started
            if started is not None and time.monotonic() - started > self.config.watchdog_timeout_s:
                self._on_hang(self.step, time.monotonic() - started)
            time.sleep(POLL_S)

    def _on_exit(self, rank: int, p: subprocess.Popen) -> None:
        if not self.serving:
            log.critical("tp rank %d (pid %d) exited with code %s during start-up", rank, p.pid, p.returncode)
            self._kill_all()
            os._exit(1)
        if p.returncode == PEER_GONE_EXIT:  # another rank is gone: give its name time to arrive
            lost = self._lost.setdefault(rank, time.monotonic())
            if time.monotonic() - lost < self.grace_s:
                return
        self._set_fault(f"{rank_name(self.tp, rank)} (pid {p.pid}) exited with code {p.returncode}")

    def _on_remote(self, problem: str) -> None:
        if not self.serving:
            log.critical("the TP group failed during start-up: %s", problem)
            self._set_fault(problem)
            os._exit(1)
        self._set_fault(problem)

    def _on_hang(self, step: int, running_s: float) -> None:
        names = ", ".join(f"{r} ({self._describe(r)})" for r in self.progress.laggards(step))
        self._set_fault(
            f"tp rank {names or '0'} has not finished step {step} after {running_s:.0f} s "
            f"(over --watchdog-timeout-s {self.config.watchdog_timeout_s:g}): it hangs"
        )

    def _describe(self, rank: int) -> str:
        if rank < self.config.ranks_per_node:  # a follower on this node
            pid = self.procs[rank - 1].pid
            return f"pid {pid}, state {state_of(pid)}"
        return self.remote.describe(rank)

    def _set_fault(self, message: str) -> None:
        with self._lock:
            if self.fault is not None:
                return
            self.fault = message
        log.error("the TP group is broken, this server cannot serve: %s", message)
        self._kill_all()
        problem = abort_collectives(self.config.device)
        if problem is not None:
            log.error("could not abort the NCCL communicators (a step may stay stuck): %s", problem)
        self._post(message)

    def _post(self, message: str) -> None:
        """Tell the other nodes (they end their ranks on any posted fault)."""
        if self.remote is not None:
            self.remote.board.set_fault(message)

    def _kill_all(self) -> None:
        for p in self.procs:
            kill(p)

    def stop(self) -> None:
        """Tell the followers to exit (unless a step is stuck or the group is broken), then end them."""
        self.stopping = True
        if self.fault is None and self.step_started is None:
            try:
                self.channel.send_stop()
            except Exception as e:  # a follower gone meanwhile: end_followers kills the rest
                log.warning("could not tell the TP ranks to stop: %r", e)
                self._post(f"node 0 could not stop the TP ranks: {e!r}")
        else:
            self._post(f"node 0 stopped with the TP group broken or a step stuck: {self.fault or 'a step runs'}")
        end_followers(self.procs, STOP_GRACE_S)
        self.progress.remove()
