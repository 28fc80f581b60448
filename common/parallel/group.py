"""The tensor-parallel process group of one server and its collectives.

One torch.distributed group of `size` ranks: gloo on the CPU, NCCL on CUDA (the model's all-reduces and
all-gathers, and the step payload), plus a gloo group for the small host-side messages (the step header,
start-up reports). `SINGLE` is the group of one rank: every collective is the identity, so a TP 1 model
runs exactly the operations it ran before tensor parallelism existed.

NCCL never raises when a peer dies: its collectives are queued on the stream and spin on the device, so
rank 0's host waits in its next read of the device (the sampled tokens) for ever (the group's timeout is a
year), unless NCCL's own watchdog notices an error and, by default, kills the process. On CUDA the group
is therefore formed eagerly on the rank's device (`device_id`), NCCL's watchdog handles no errors
(TORCH_NCCL_ASYNC_ERROR_HANDLING=0, unless the operator set it), and rank 0's supervisor
(common.ranks.ranks) detects a dead or hung rank itself and calls `abort_collectives`: the
communicators are aborted, the spinning kernels end, the waiting read returns, and the step is failed.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.wire.addresses import split_host_port

PEER_GONE_EXIT = 3  # a follower's exit code after a collective failed: a consequence of a fault elsewhere


class PeerGone(RuntimeError):
    """A collective failed: another rank of the group is gone (its connection closed)."""


def _collective(op, *args, **kwargs):
    """`op(*args, **kwargs)`, a collective (on every layer's path: a plain call, no context manager)."""
    try:
        return op(*args, **kwargs)
    except RuntimeError as e:  # gloo and NCCL raise it when a peer's connection breaks
        raise PeerGone(str(e).splitlines()[0]) from e


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.enabled:
            _collective(dist.all_reduce, x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dimension, in rank order."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective(dist.all_gather, parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, host: bool = False) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype); `host`: over the gloo group."""
        if self.enabled:
            _collective(dist.broadcast, x, src=0, group=_host_group() if host else None)
        return x

    def all_gather_objects(self, obj: object) -> list:
        """Every rank's picklable `obj`, in rank order (start-up reports only: slow)."""
        if not self.enabled:
            return [obj]
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=_host_group())
        return out

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pool size all ranks can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_host_group())
        return int(t.item())


SINGLE = TensorParallel()
NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def abort_collectives(device: str) -> str | None:
    """CUDA: abort every NCCL communicator of this process, so that the collectives queued on its stream
    end and a host read waiting behind them returns (what it reads is garbage: the caller fails the
    step). Returns why it could not, or None. The CPU's gloo raises on a closed peer by itself."""
    if device != "cuda" or not dist.is_initialized():
        return None
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as e:  # the group is broken either way; the caller logs this
        return repr(e)
    return None


CONNECT_TRY_S = 3.0
_HOST_GROUP: list = []


def _host_group():
    return _HOST_GROUP[0] if _HOST_GROUP else None


def host_store(addr: str, size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0: the group's rendezvous store, listening on `addr`'s port (HOST:PORT) on every interface
    (torch's TCPStore binds no one address)."""
    _, port = split_host_port(addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore("0.0.0.0", port, size, True, timeout, wait_for_workers=False)


def join_store(addr: str, timeout_s: float) -> dist.TCPStore:
    """Any other rank or host: a client of rank 0's store at `addr`, waiting up to `timeout_s` for it to
    listen, tried every few seconds (one long try backs off ever longer between its attempts)."""
    host, port = split_host_port(addr)
    deadline = time.monotonic() + timeout_s
    while True:
        try_s = max(0.1, min(CONNECT_TRY_S, deadline - time.monotonic()))
        try:
            store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=try_s), wait_for_workers=False)
        except (RuntimeError, TimeoutError):  # not listening yet (torch.distributed.DistError)
            if time.monotonic() >= deadline:
                raise
            continue
        store.set_timeout(datetime.timedelta(seconds=timeout_s))  # how long a rank waits for the others
        return store


def init_group(rank: int, size: int, store: dist.Store, device: str, timeout_s: float, per_host: int) -> TensorParallel:
    """Join the group of `size` ranks that meet in `store` (see host_store / join_store); `per_host`
    ranks share this host: on CUDA the rank's index on its host picks its GPU."""
    extra = {}
    if device == "cuda":
        torch.cuda.set_device(rank % per_host)
        os.environ.setdefault(NCCL_ERROR_HANDLING_ENV, "0")  # the supervisor decides (see above)
        extra["device_id"] = torch.device("cuda", rank % per_host)  # the communicator is formed now
    else:  # the ranks share the cores: more threads each would spin against each other in every collective
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_host))
    dist.init_process_group(
        backend="nccl" if device == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **extra,
    )
    _HOST_GROUP[:] = [dist.new_group(backend="gloo") if device == "cuda" else dist.group.WORLD]
    return TensorParallel(rank, size)
