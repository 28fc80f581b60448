"""Ports for test servers, handed out so that servers started side by side never race for one.

A port picked by binding port 0 lies in the kernel's ephemeral range, where every outgoing connection,
every ZMQ `bind_to_random_port` and every gloo or UCX listener of the servers starting meanwhile may take
it before its server binds. These ports come from below that range (and above Mooncake's RPC ports,
15000-17000), where nothing picks a port on its own. Each pytest process claims blocks of them with a
lock file (released when the process ends), so that two test runs on one machine never hand out the same
port; a port something else listens on is skipped. What is left, a program that binds one of these on
purpose in the seconds before its server does, ServerProcess survives by moving its server to fresh
ports (tests/conftest.py).
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

LOWEST = 20000  # above Mooncake's RPC ports
BLOCK = 256  # ports a lock file claims
LOCKS = Path(tempfile.gettempdir()) / "tandem-test-ports"


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def blocks() -> list[range]:
    """The blocks below the ephemeral range (above it where it starts too low to leave any)."""
    low, high = ephemeral_range()
    start, end = (LOWEST, low) if low - LOWEST >= BLOCK else (high + 1, 65536)
    return [range(p, p + BLOCK) for p in range(start, end - BLOCK + 1, BLOCK)]


def claimed_blocks() -> Iterator[range]:
    """Blocks no other process holds, each claimed for this process's life (its lock file stays open),
    starting at a place that depends on the process id."""
    LOCKS.mkdir(exist_ok=True)
    all_blocks = blocks()
    first = os.getpid() % len(all_blocks)
    for block in all_blocks[first:] + all_blocks[:first]:
        fd = os.open(LOCKS / str(block.start), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        yield block  # the fd stays open, and the block this process's, until it exits
    raise RuntimeError(f"every test port block from {all_blocks[0].start} is held by another process")


def listenable(port: int) -> bool:
    """Nothing listens on the port, at any address (servers bind 127.0.0.1, Mooncake 0.0.0.0)."""
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def _ports() -> Iterator[int]:
    for block in claimed_blocks():
        yield from (p for p in block if listenable(p))


_next = _ports()
_lock = threading.Lock()  # tests start servers from threads too


def free_port() -> int:
    """A port no other test of any run on this machine was given, free now and outside the range where
    anything picks ports by itself."""
    with _lock:
        return next(_next)
