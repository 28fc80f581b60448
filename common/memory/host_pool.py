"""The host tier of the KV cache: a second page-major buffer in host memory (pinned on CUDA) with its own
page allocator, and the copies of whole pages between it and the device pool.

    buffer: [num_pages + 1, *device_pool.buffer.shape[1:]]   (page 0 is padding, as on the device)

A page holds every layer's K and V of its tokens (MLA: the latent plane), so a run of consecutive pages
on both sides is one contiguous copy. On CUDA the copies run on the pool's own stream: the stream first
waits for the work already queued on the compute stream (the KV being copied out was written by it, the
pages being loaded into may still be read by it), and an event is recorded after them. A load makes the
compute stream wait on it (the next forward must not read a page before it arrives); a write does not (no
forward reads the host): it returns the event, and the caller keeps the device pages from being reused
until it has passed (common.memory.hicache). No host sync. On the CPU a copy is a copy, done on return.
"""

from __future__ import annotations

import torch

from common.memory.allocator import PagedAllocator
from common.memory.errors import MemoryIntegrityError
from common.memory.kv_pool import KVPool
from common.wire.page_runs import page_runs


class HostPool:
    def __init__(self, device_pool: KVPool, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the host tier needs at least one page, got {num_pages}")
        dev = device_pool.buffer
        self.device_buffer, self.page_size = dev, device_pool.page_size
        self.pinned = dev.is_cuda
        self.buffer = torch.zeros((num_pages + 1, *dev.shape[1:]), dtype=dev.dtype, pin_memory=self.pinned)
        self.allocator = PagedAllocator(num_pages, self.page_size)
        self.stream = torch.cuda.Stream(dev.device) if self.pinned else None
        self.pages_written = 0  # device -> host, since start
        self.pages_loaded = 0  # host -> device

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def bytes_per_page(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    def write(self, device_pages: list[int], host_pages: list[int]) -> torch.cuda.Event | None:
        """Copy device pages out to host pages; returns the event after which the device pages may be
        reused (None: done already, on the CPU). The compute stream goes on meanwhile."""
        self.pages_written += len(host_pages)
        return self._copy(self.buffer, host_pages, self.device_buffer, device_pages)

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages back into device pages; the compute stream waits for it (a forward reads them)."""
        done = self._copy(self.device_buffer, device_pages, self.buffer, host_pages)
        if done is not None:
            torch.cuda.current_stream(self.device_buffer.device).wait_event(done)
        self.pages_loaded += len(host_pages)

    def _copy(self, dst: torch.Tensor, dst_pages: list[int], src: torch.Tensor, src_pages: list[int]):
        runs = list(zip(*(x.tolist() for x in page_runs(src_pages, dst_pages))))
        if self.stream is None:
            for s, d, n in runs:
                dst[d : d + n].copy_(src[s : s + n])
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device_buffer.device))
        with torch.cuda.stream(self.stream):
            for s, d, n in runs:
                dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def describe(self) -> str:
        mib = (self.num_pages + 1) * self.bytes_per_page / 2**20
        where = "pinned host memory" if self.pinned else "host memory"
        return f"host tier: {self.num_pages} pages x {self.page_size} tokens, {mib:.1f} MiB in {where}"

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        if self.buffer.shape[1:] != self.device_buffer.shape[1:]:
            raise MemoryIntegrityError("the host pool's page shape differs from the device pool's")
