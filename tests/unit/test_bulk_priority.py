"""Bulk KV copies run below the threads on a first token's path (transfer/bulk_priority.py)."""

from __future__ import annotations

import os
import threading

import pytest

from transfer.bulk_priority import BULK_NICE, create_lowered
from transfer.prefill.transfer_worker import TransferWorker

pytestmark = pytest.mark.skipif(not hasattr(os, "getpriority"), reason="nice is a POSIX notion")


def nice_of(thread: threading.Thread) -> int:
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


def lowered() -> int:
    return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + BULK_NICE)


def test_threads_a_lowered_constructor_starts_run_at_bulk_nice_and_the_caller_does_not():
    started = threading.Event()
    stop = threading.Event()

    def make_engine() -> threading.Thread:  # as a transfer engine starts its own threads when created
        t = threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True)
        t.start()
        return t

    engine_thread = create_lowered(make_engine)
    started.wait(5)
    try:
        assert nice_of(engine_thread) == lowered()
        assert nice_of(threading.current_thread()) == lowered() - BULK_NICE
    finally:
        stop.set()


def test_a_lowered_constructor_passes_its_error_on():
    def broken() -> None:
        raise RuntimeError("no such device")

    with pytest.raises(RuntimeError, match="no such device"):
        create_lowered(broken)


def test_a_transfer_worker_runs_at_bulk_nice():
    worker = TransferWorker(
        "decode-abc123", write=lambda chunk: 0, notify=lambda *a: None, mark_failed=lambda *a: True, max_chunks=4
    )
    thread = next(t for t in threading.enumerate() if t.name == "kv-transfer-abc123")
    for _ in range(100):  # it lowers itself as it starts
        if nice_of(thread) == lowered():
            break
        threading.Event().wait(0.01)
    assert nice_of(thread) == lowered()
    worker.retired = True
