"""`tandem router --processes N`: N router processes serve one port (SO_REUSEPORT: the kernel spreads client
connections over them), so the router is not bound to one core. The process started by the command only
supervises them: it starts them, starts again one that dies, and passes SIGTERM and SIGINT on to them
(so the first SIGTERM drains them all, router/serve.py).

What the processes share, and what each one derives on its own:

    shared   metrics              prometheus_client's multiprocess mode: each process writes its own files in
                                  one directory, and /metrics of any process adds them all up
             workers added or     a file in the same directory, rewritten under a lock by the process that
             removed at run time  took the change and followed by the others within half a second
                                  (router/shared_workers.py)
             stored responses     one SQLite file in the same directory (common/wire/responses_store.py): any
                                  process reads, deletes or cancels what another stored or streams
    derived  worker health        each process checks every worker itself (once before it listens: a
                                  process started in place of a dead one answers no 503 for want of it)
             load and policies    each process sees the requests it serves: a worker's requests in flight,
                                  the round-robin position and cache-aware prefixes are per process
             concurrency limit    each process admits its share of --max-concurrent-requests
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SHARED_DIR_ENV = "TANDEM_ROUTER_SHARED_DIR"  # set by the supervisor for the processes it starts
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # forwarded to every process
EARLY_EXIT_S = 5.0  # a process that exits by itself this soon after its start would fail again

log = logging.getLogger("tandem.router")


def shared_dir() -> str | None:
    """The directory this process shares with its siblings, or None for a router that runs alone."""
    return os.environ.get(SHARED_DIR_ENV)


def supervise(argv: list[str], processes: int, stop_wait_s: float) -> int:
    """Run `tandem router argv` in `processes` processes until they are stopped; the exit status. SIGTERM and
    SIGINT go on to every process (the first SIGTERM drains them); a process still running `stop_wait_s`
    after the first one is killed."""
    shared = tempfile.mkdtemp(prefix="tandem-router-")
    metrics_dir = os.path.join(shared, "metrics")
    os.mkdir(metrics_dir)
    env = os.environ | {SHARED_DIR_ENV: shared, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    cmd = [sys.executable, "-m", "tandem", "router", *argv]
    children: list[tuple[subprocess.Popen, float]] = []
    signals: list[int] = []

    def forward(signum: int, _frame) -> None:
        signals.append(signum)
        for proc, _ in children:
            if proc.poll() is None:
                proc.send_signal(signum)

    def start(slot: int) -> None:
        """A process in children[slot], listed before a stop signal can be handled: one that arrives while it
        starts is held until then, so that it is forwarded to this process too (none is left running)."""
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:  # the child unblocks them before it runs Python
            proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_SETMASK, held))
            children[slot : slot + 1] = [(proc, time.monotonic())]
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    try:
        for slot in range(processes):
            start(slot)
        while not signals:
            time.sleep(0.2)
            for i, (proc, started) in enumerate(children):
                if proc.poll() is None or signals:
                    continue
                _forget(proc.pid, metrics_dir)
                if proc.returncode >= 0 and time.monotonic() - started < EARLY_EXIT_S:  # not killed: failed to start
                    log.error("router process %d exited with %d at start; stopping", proc.pid, proc.returncode)
                    forward(signal.SIGINT, None)
                    return proc.returncode or 1
                log.warning("router process %d exited with %d; starting another", proc.pid, proc.returncode)
                start(i)
        asked = {-signum for signum in signals}  # a process still starting ends by the signal itself
        return _wait_all([proc for proc, _ in children], time.monotonic() + stop_wait_s, asked)
    finally:
        for proc, _ in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(shared, ignore_errors=True)


def _wait_all(procs: list[subprocess.Popen], deadline: float, asked: set[int]) -> int:
    """0 when every process stopped cleanly by the deadline (the others are killed then), else 1. Cleanly: it
    exited with 0 (it drained), or by a signal in `asked` (as a negative exit code), the signal forwarded to it
    while it was still starting, before it installed its handler (it had served nothing)."""
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("router process %d still running; killing it", proc.pid)
            proc.kill()
            proc.wait()
    return 0 if all(proc.returncode == 0 or proc.returncode in asked for proc in procs) else 1


def _forget(pid: int, metrics_dir: str) -> None:
    """Drop a dead process's live gauges (its counters stay counted)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, metrics_dir)
