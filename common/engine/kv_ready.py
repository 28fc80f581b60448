"""When the KV a forward wrote may be read by someone other than the next forward: the transfer.

A forward only queues its kernels on CUDA; the pages it writes are complete when the device reaches the
event recorded right after it, not when `run()` returns. The prefill's transfer worker (another thread,
reading the pages through NIXL or Mooncake, outside torch's stream order) waits on that event before its
first read of a chunk's pages. Nothing else orders them: without the wait, an engine that no longer syncs
the host by accident (no pageable copy, CUDA graphs) would send half-written pages, i.e. wrong tokens and
no error.

On the CPU a forward is done when it returns; HostEvent keeps the same interface so the rule holds, and is
tested, on every device.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVReady(Protocol):
    """torch.cuda.Event's part that the transfer uses."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class HostEvent:
    """The CPU's event: the work before `record()` is already done; `synchronize()` only says it waited."""

    def __init__(self) -> None:
        self.recorded = False
        self.waited = False

    def record(self) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        if not self.recorded:
            raise RuntimeError("waited on a KV event that was never recorded")
        self.waited = True


def record_kv_ready(device: str | torch.device) -> KVReady:
    """An event recorded now, on the current stream of `device`: after the forward just queued."""
    event: KVReady = torch.cuda.Event() if torch.device(device).type == "cuda" else HostEvent()
    event.record()
    return event
