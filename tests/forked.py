"""Model servers forked from a process that has already imported what `tandem serve` imports.

A `python -m tandem serve` spends most of its start-up importing torch, transformers and the engine (about 7 of
the 12 s a built-in model server takes to be ready here). The suite starts a few hundred of them, so each one
started by ServerProcess is forked from multiprocessing's fork server instead, whose process imported those
modules once. From the fork on, the child runs what `python -m tandem` runs: `tandem.cli.main` with the same
arguments, in the test's environment and working directory, its stdout and stderr in the test's log file.

A PYTHONPATH the test gives a server is applied as Python's start-up would: its directories go first on
sys.path and a sitecustomize among them runs, before `main` (the KV fault site, tests/integration/kv_faults.py).
A server run inside a network namespace (`ip netns exec NAME`, tests/integration/netns.py) is forked too: the
child first does what `ip netns exec` does before it runs its command (`enter_netns`). Not forked, but started
as `python -m tandem`: a command other than `serve`, a server run inside anything else (a container), and every
server when TANDEM_TEST_FORK=0. Nothing here imports CUDA or starts a thread before the fork (the fork server
only imports).

The rank processes a forked TP server starts (common.ranks.launch `start_follower`) are forked by the same fork
server: the server asks it as its parent would (the fork server's address and "alive" pipe came with the fork),
and the rank runs `python -m ENTRY ARGV`'s module with the server's environment and network namespace, its stdin a
pipe from the server (its end closes when the server dies, however) and its output in the server's log. The fork
server reaps it and reports its exit code, so a rank's exit is seen as before; it is not joined when the server
exits.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import os
import runpy
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

# what `tandem serve` imports before it loads a model; imported once, in the fork server
PRELOAD = [
    "torch",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.configuration_llama",
    "tandem.cli",
    "tandem.server",
    "common.engine.engine",
    "common.http.app",
    "prefill_node.compose",
    "decode_node.compose",
    "uvicorn",
]
CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000  # <sched.h>
MS_BIND, MS_REC, MS_SLAVE, MNT_DETACH = 4096, 16384, 1 << 19, 2  # <sys/mount.h>
_context: multiprocessing.context.ForkServerContext | None = None
_netns: str | None = None  # in a forked child: the network namespace it entered
_started: list[ForkedServer] = []


def can_fork(argv: list[str], prefix: tuple[str, ...]) -> bool:
    """Whether this command may run forked (see the module docstring)."""
    wanted = os.environ.get("TANDEM_TEST_FORK", "1") != "0"
    inside = not prefix or netns_of(prefix) is not None
    return wanted and argv[:1] == ["serve"] and inside and sys.platform == "linux"


def netns_of(prefix: tuple[str, ...]) -> str | None:
    """NAME, for the prefix `ip netns exec NAME`."""
    return prefix[3] if len(prefix) == 4 and prefix[:3] == ("ip", "netns", "exec") else None


def enter_netns(name: str) -> None:
    """In a forked child, before anything else: what `ip netns exec NAME` does before it runs its command
    (iproute2's netns_switch). Join the network namespace; in a mount namespace of the child's own, mount that
    network's /sys, and bind /etc/netns/NAME's files over /etc's (the hosts file of `Network.name_hosts`)."""
    global _netns
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what} for network namespace {name}: {os.strerror(ctypes.get_errno())}")

    with open(f"/var/run/netns/{name}") as ns:
        check(libc.setns(ns.fileno(), CLONE_NEWNET), "setns")
    check(libc.unshare(CLONE_NEWNS), "unshare")
    check(libc.mount(b"", b"/", b"none", MS_SLAVE | MS_REC, None), "mount / slave")
    libc.umount2(b"/sys", MNT_DETACH)  # as ip: none mounted is fine
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount /sys")
    etc = Path("/etc/netns") / name
    for f in sorted(etc.iterdir()) if etc.is_dir() else []:
        check(libc.mount(str(f).encode(), f"/etc/{f.name}".encode(), b"none", MS_BIND, None), f"bind {f}")
    _netns = name


def fork_server() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run_tandem(
    argv: list[str], env: dict[str, str], cwd: str, log_path: str, site_path: str | None, netns: str | None
) -> None:
    """In the forked child: what `python -m tandem ARGV` runs, with the test's environment and log file (and
    `site_path`, the PYTHONPATH the test gave, applied), inside network namespace `netns` if one is named."""
    if netns is not None:
        enter_netns(netns)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    become(env, cwd, log)
    os.close(log)
    if site_path:
        load_site(site_path)
    from common.ranks import launch
    from tandem.cli import main

    multiprocessing.forkserver._forkserver.ensure_running = lambda: None  # ours runs: its address came with us
    launch.start_follower = fork_follower
    main(argv)


def run_module(
    entry: str, argv: list[str], env: dict[str, str], cwd: str, stdin: Connection, out: Connection, netns: str | None
) -> None:
    """In a forked rank process: what `python -m ENTRY ARGV` runs, with its starter's stdin pipe and output, in
    its starter's network namespace."""
    if netns is not None:
        enter_netns(netns)
    os.dup2(stdin.fileno(), 0)
    sys.stdin = open(0, closefd=False)
    become(env, cwd, out.fileno())
    stdin.close()
    out.close()
    load_site(env.get("PYTHONPATH", ""))
    sys.argv = [entry, *argv]
    runpy.run_module(entry, run_name="__main__", alter_sys=True)


def become(env: dict[str, str], cwd: str, out_fd: int) -> None:
    """The forked child's stdout and stderr on `out_fd` (line-buffered, as PYTHONUNBUFFERED), its environment,
    working directory and SIGINT as a new Python process has them."""
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def load_site(python_path: str) -> None:
    """What Python's start-up does with PYTHONPATH: its directories first on sys.path, the first
    sitecustomize.py among them run."""
    dirs = [d for d in python_path.split(os.pathsep) if d]
    sys.path[:0] = dirs
    site = next((Path(d) / "sitecustomize.py" for d in dirs if (Path(d) / "sitecustomize.py").exists()), None)
    if site is not None:
        runpy.run_path(str(site), run_name="sitecustomize")


class ForkedProcess:
    """subprocess.Popen's interface (poll, wait, returncode, signals, stdin) over a child of the fork server
    running `target(*work)`."""

    def __init__(self, args: list[str], target, work: tuple, stdin=None):
        self.args, self.stdin = args, stdin
        self._child = fork_server().Process(target=target, args=work)
        self._child.start()
        self.pid = self._child.pid

    @property
    def returncode(self) -> int | None:
        return self._child.exitcode

    def poll(self) -> int | None:
        return self._child.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._child.join(timeout)
        if self._child.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._child.exitcode

    def send_signal(self, sig: int) -> None:
        if self._child.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedServer(ForkedProcess):
    """`tandem serve ARGV` forked, in the test's environment, working directory and log file."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: Path,
        log_path: Path,
        site_path: str | None,
        prefix: tuple[str, ...] = (),
    ):
        work = (argv, env, str(cwd), str(log_path), site_path, netns_of(prefix))
        super().__init__(["tandem", *argv], run_tandem, work)
        _started.append(self)


def fork_follower(entry: str, argv: list[str], env: dict[str, str]) -> ForkedProcess:
    """common.ranks.launch's `start_follower` in a forked server (the module docstring)."""
    r, w = os.pipe()
    stdin, out = Connection(r, writable=False), Connection(os.dup(1), readable=False)
    try:
        work = (entry, argv, env, os.getcwd(), stdin, out, _netns)
        rank = ForkedProcess(["python", "-m", entry, *argv], run_module, work, stdin=open(w, "wb"))
    finally:
        stdin.close()
        out.close()
    multiprocessing.process._children.discard(rank._child)  # the server's exit does not wait for it
    return rank


def kill_left_over() -> None:
    """At the session's end: a forked server that a test left running is killed (multiprocessing's exit would
    wait for it)."""
    for server in _started:
        server.kill()
        server.wait(10)
