"""Bulk KV copies yield the CPU to latency-critical threads.

Where a transfer engine moves bytes with the CPU (TCP, UCX over shared memory), its threads compete for the
cores with the threads on a first token's path: the scheduler, the HTTP event loop, and on a shared host
the router. The copies run BULK_NICE below the process's nice, so the kernel gives a waking
latency-critical thread the core at once; an idle core still runs the copy at full speed. Linux sets nice
per thread and a new thread takes its creator's, so the engine's backend is created on a lowered thread
(its own threads inherit it) and each transfer worker lowers itself. Elsewhere, or where it is refused,
nothing changes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

BULK_NICE = 10
T = TypeVar("T")


def lower_this_thread() -> None:
    """Run the calling thread (only it: Linux's nice is per thread) BULK_NICE below where it runs."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BULK_NICE))
    except (AttributeError, OSError):
        pass


def create_lowered(make: Callable[[], T]) -> T:
    """`make()` run on a lowered thread, so the threads it starts run there too; its result or error."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        lower_this_thread()
        try:
            result.append(make())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=run, name="kv-backend-init")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
