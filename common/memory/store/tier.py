"""The store tier's worker: one thread between the host pool and a StoreBackend, so that no store call ever
runs on the scheduler thread.

The scheduler thread submits jobs (read these pages of a prefix into these host pages; write these host
pages out) and collects them when done (`finished()`, once per step); the worker hashes, checks, reads and
writes. A job's host pages belong to the job until it is collected: the scheduler side (store_cache.py) keeps
a written page's host node locked and a read page out of every tree until then.

Unavailable store (a connection that fails, a call that raises StoreUnavailable, or one running longer than
`io_timeout_s`): the tier is marked down, every job submitted meanwhile finishes at once as skipped (counted),
and the worker tries the store again every `retry_interval_s`; the first success brings it back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from common.memory.store.backend import StoreBackend, StoreUnavailable
from common.memory.store.keys import page_key, prefix_digests
from common.memory.store.objects import HEADER_BYTES, pack_header, verify

log = logging.getLogger(__name__)
T = TypeVar("T")
CHUNK = 256  # pages per backend call
PROBE_KEY = "tandem-probe"


@dataclass
class StoreJob:
    """Pages first .. first + len(host_pages) - 1 of `tokens`, to read into or write from `host_pages`."""

    kind: str  # "read" or "write"
    tokens: list[int]  # cache keys (Req.cache_key's)
    first: int
    host_pages: list[int]
    owner: object = None  # what the scheduler side needs back (a locked node, a prefetch)
    copied: object = None  # write, on CUDA: the event after the device-to-host copies of its pages
    pages_ok: int = 0  # read: leading pages loaded and verified; write: leading pages the store holds
    skipped: bool = False  # the store was unavailable: nothing was read or written
    lora_name: str | None = None  # the LoRA adapter the pages were computed under (None: the base model)


class StoreTier:
    def __init__(
        self,
        backend: StoreBackend,
        host_buffer: torch.Tensor,
        namespace: str,
        page_size: int,
        io_timeout_s: float,
        retry_interval_s: float,
        wake: Callable[[], None] = lambda: None,
    ):
        self.backend, self.host_buffer, self.namespace, self.page_size = backend, host_buffer, namespace, page_size
        self.io_timeout_s, self.retry_interval_s, self.wake = io_timeout_s, retry_interval_s, wake
        self.available = False  # read by the scheduler thread; written by both (under _lock)
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(
            (
                "pages_read",
                "pages_written",
                "bytes_read",
                "bytes_written",
                "refused",
                "corrupt",
                "skipped",
                "unavailable",
            ),
            0,
        )
        self._jobs: queue.SimpleQueue[StoreJob | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[StoreJob] = queue.SimpleQueue()
        self._call_started: float | None = None  # when the store call running now began
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-store", daemon=True)
        self._thread.start()

    # -- scheduler thread ------------------------------------------------------------------------
    def submit(self, job: StoreJob) -> None:
        if not self.available:
            self._skip(job)
        else:
            self._jobs.put(job)

    def finished(self) -> list[StoreJob]:
        """Jobs done since the last call; marks the store down if the running one is past its bound."""
        started = self._call_started
        if started is not None and time.monotonic() - started > self.io_timeout_s:
            self._down(f"a store call has run for over {self.io_timeout_s:g} s")
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._running = False
        self._jobs.put(None)
        self._thread.join(timeout=self.io_timeout_s + 1)
        self.backend.close()

    # -- worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        next_try = 0.0
        while self._running:
            if not self.available and time.monotonic() >= next_try:
                self._reach()
                next_try = time.monotonic() + self.retry_interval_s
            try:
                job = self._jobs.get(timeout=self.retry_interval_s)
            except queue.Empty:
                continue
            if job is None:
                return
            if not self.available:
                self._skip(job)
                continue
            try:
                (self._read if job.kind == "read" else self._write)(job)
            except StoreUnavailable as e:
                self._down(str(e))
                job.pages_ok, job.skipped = 0, True
            except Exception:
                log.exception("KV store: a %s job failed", job.kind)
                job.pages_ok = 0
            self._finish(job)

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        """One store call, timed for finished()'s bound."""
        self._call_started = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._call_started = None

    def _reach(self) -> None:
        """Connect, or probe the store after it was unavailable; available again on success."""
        try:
            self.backend.connect()
            self.backend.exists([PROBE_KEY])
        except StoreUnavailable as e:
            log.debug("KV store still unavailable: %s", e)
            return
        except Exception:
            log.exception("KV store: connecting failed")
            return
        log.info("KV store available: %s", self.backend.describe())
        with self._lock:
            self.available = True

    def _down(self, why: str) -> None:
        with self._lock:
            was, self.available = self.available, False
        if was:
            self._count("unavailable")
            log.warning(
                "KV store unavailable (%s): serving without it, trying again every %g s", why, self.retry_interval_s
            )

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:  # both threads count
            self.counts[key] += n

    def _skip(self, job: StoreJob) -> None:
        job.pages_ok, job.skipped = 0, True
        self._count("skipped")
        self._finish(job)

    def _finish(self, job: StoreJob) -> None:
        self._done.put(job)
        self.wake()

    def _keys(self, job: StoreJob) -> tuple[list[bytes], list[str]]:
        digests = prefix_digests(job.tokens, self.page_size, job.first, len(job.host_pages), job.lora_name)
        return digests, [page_key(self.namespace, d) for d in digests]

    def _page(self, host_page: int) -> torch.Tensor:
        return self.host_buffer[host_page].view(torch.uint8).reshape(-1)

    def _read(self, job: StoreJob) -> None:
        digests, keys = self._keys(job)
        present = self._exists(keys)
        n = next((i for i, p in enumerate(present) if not p), len(present))
        for start in range(0, n, CHUNK):
            pages = [self._page(p) for p in job.host_pages[start : min(n, start + CHUNK)]]
            headers = self._call(self.backend.get, keys[start : start + len(pages)], pages)
            for i, (header, page) in enumerate(zip(headers, pages, strict=True)):
                if header is None:
                    return
                why = verify(header, digests[start + i], page.numpy().data)
                if why is not None:
                    self._count("corrupt")
                    log.warning("KV store: page %s refused: %s", keys[start + i], why)
                    return
                job.pages_ok += 1
                self._count("pages_read")
                self._count("bytes_read", HEADER_BYTES + page.numel())

    def _write(self, job: StoreJob) -> None:
        if job.copied is not None:
            job.copied.synchronize()
        digests, keys = self._keys(job)
        held = self._exists(keys)
        missing = [i for i, h in enumerate(held) if not h]
        for start in range(0, len(missing), CHUNK):
            idx = missing[start : start + CHUNK]
            pages = [self._page(job.host_pages[i]) for i in idx]
            headers = [pack_header(digests[i], p.numpy().data) for i, p in zip(idx, pages, strict=True)]
            for i, ok, page in zip(
                idx, self._call(self.backend.put, [keys[i] for i in idx], headers, pages), pages, strict=True
            ):
                held[i] = ok
                if not ok:
                    self._count("refused")
                    continue
                self._count("pages_written")
                self._count("bytes_written", HEADER_BYTES + page.numel())
        job.pages_ok = next((i for i, h in enumerate(held) if not h), len(held))

    def _exists(self, keys: list[str]) -> list[bool]:
        out: list[bool] = []
        for start in range(0, len(keys), CHUNK):
            out += self._call(self.backend.exists, keys[start : start + CHUNK])
        return out
