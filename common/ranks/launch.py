"""Rank 0 (or, with --nnodes > 1, node k's process) starts this node's follower processes
(`python -m ENTRY`: common.ranks.follower, or the entry point its starter names, which adds what else a
rank runs: `tandem serve`'s adds a PD rank's KV transfer agent) and ends them.

A follower's stdin is a pipe from its starter that is never written: when the starter dies in any way
(even SIGKILL), the pipe closes and the follower exits (common.ranks.follower). Followers ignore
SIGINT and SIGTERM: a stop reaches them from rank 0 once it drained.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
FOLLOWER = "common.ranks.follower"  # a follower that runs the model only


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_addr(config: ServerConfig) -> str:
    """Where rank 0 serves the group's rendezvous store: --dist-init-addr, else a free port of this node."""
    return config.dist_init_addr or f"127.0.0.1:{free_port()}"


def local_ranks(config: ServerConfig) -> range:
    """The ranks this node runs (--node-rank's share of --tp-size), rank 0 included on node 0."""
    per = config.ranks_per_node
    return range(config.node_rank * per, (config.node_rank + 1) * per)


def spawn_followers(config: ServerConfig, addr: str, progress_path: str, entry: str) -> list[subprocess.Popen]:
    """This node's ranks but rank 0, each `python -m entry` told the group's address, the progress file and
    the config."""
    argv = ["--size", str(config.tp_size), "--addr", addr, "--progress", progress_path]
    argv += ["--config", json.dumps(config.model_dump(mode="json"))]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return [start_follower(entry, ["--rank", str(rank), *argv], env) for rank in local_ranks(config) if rank != 0]


def start_follower(entry: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`python -m entry ARGV`, its stdin a pipe from this process that is never written (the module docstring)."""
    return subprocess.Popen([sys.executable, "-m", entry, *argv], stdin=subprocess.PIPE, env=env)


def end_followers(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to `grace_s` for every follower to exit, then kill what is left, and reap all."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill(p)
    for p in procs:
        if p.stdin is not None:
            p.stdin.close()


def kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGCONT)
        p.kill()
        p.wait()


def state_of(pid: int) -> str:
    """The process's state letter from /proc (T: stopped), '?' when unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"
