"""Rank 0 starts the follower processes (`python -m common.parallel.follower`) and ends them.

A follower's stdin is a pipe from rank 0 that is never written: when rank 0 dies in any way (even
SIGKILL), the pipe closes and the follower exits (common.parallel.follower). Followers ignore SIGINT
and SIGTERM: a stop reaches them from rank 0 once it drained.
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
# a PD server's followers also run their own KV transfer engine (transfer.rank_agent), started by tandem's
# entry point: common does not import the transfer layer
FOLLOWER = {False: "common.parallel.follower", True: "tandem.rank_follower"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_followers(config: ServerConfig, port: int, progress_path: str) -> list[subprocess.Popen]:
    """Ranks 1..tp_size-1, each told the group's port, the progress file and the server's config."""
    argv = ["--size", str(config.tp_size), "--port", str(port), "--progress", progress_path]
    argv += ["--config", json.dumps(config.model_dump(mode="json"))]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return [
        subprocess.Popen(
            [sys.executable, "-m", FOLLOWER[config.disagg_mode != "null"], "--rank", str(rank), *argv],
            stdin=subprocess.PIPE,
            env=env,
        )
        for rank in range(1, config.tp_size)
    ]


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
