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
import logging
import math
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.wire.addresses import split_host_port
from common.wire.user_error import UserError

log = logging.getLogger(__name__)
PEER_GONE_EXIT = 3  # a follower's exit code after a collective failed: a consequence of a fault elsewhere
SENT: Counter[str] = Counter()  # bytes this rank put into each kind of collective (docs/performance.md)


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
    """The server's ranks. `ep`: MoE layers hold whole experts per rank (--ep-size), not a slice of every
    expert; `dp_attention`: each rank runs its own requests' attention and dense layers whole
    (--enable-dp-attention), and only the MoE layers and the LM head span the ranks (docs/dp-attention.md)."""

    rank: int = 0
    size: int = 1
    ep: bool = False
    dp_attention: bool = False
    redundant_experts: int = 0  # --ep-num-redundant-experts: extra copies of experts over the EP ranks

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def attn(self) -> TensorParallel:
        """The group attention, the dense layers and the embedding are split over: every rank, or this rank
        alone under DP attention."""
        return SINGLE if self.dp_attention else self

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.enabled:
            SENT["all_reduce"] += x.numel() * x.element_size()
            _collective(dist.all_reduce, x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dimension, in rank order."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective(dist.all_gather, parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's rows of `x` (rank r has `counts[r]`, maybe none) concatenated in rank order."""
        if not self.enabled:
            return x
        width = max(counts)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        SENT["all_gather"] += padded.numel() * padded.element_size()
        _collective(dist.all_gather, parts, padded)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    def reduce_scatter_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Of `x` (every rank's rows, as all_gather_rows gave them), the sum over the ranks of this rank's rows."""
        if not self.enabled:
            return x
        width = max(counts)
        padded = x.new_zeros((self.size * width, *x.shape[1:]))
        start = 0
        for r, n in enumerate(counts):
            padded[r * width : r * width + n] = x[start : start + n]
            start += n
        out = x.new_empty((width, *x.shape[1:]))
        SENT["reduce_scatter"] += padded.numel() * padded.element_size()
        _collective(dist.reduce_scatter_tensor, out, padded)
        return out[: counts[self.rank]]

    def all_to_all_rows(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of `x` sent to each rank in turn (`send[r]` to rank r); the rows received, `recv[r]` from rank r."""
        out = x.new_empty((sum(recv), *x.shape[1:]))
        row = math.prod(x.shape[1:]) * x.element_size()  # also of an idle rank's zero rows
        SENT["all_to_all"] += row * (sum(send) - send[self.rank])  # what leaves this rank
        _collective(dist.all_to_all_single, out, x.contiguous(), recv, send)
        return out

    def all_to_all_counts(self, send: torch.Tensor) -> torch.Tensor:
        """[size] int64: how many rows each rank sends us, from how many we send each (`send`)."""
        out = torch.empty_like(send)
        _collective(dist.all_to_all_single, out, send)
        return out

    def broadcast(self, x: torch.Tensor, host: bool = False, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` into every rank's `x` (same shape and dtype); `host`: over the gloo group."""
        if self.enabled:
            _collective(dist.broadcast, x, src=src, group=_host_group() if host else None)
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


def serve_rendezvous(addr: str, size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0: the group's rendezvous store, listening on `addr`'s port (HOST:PORT) on every interface
    (torch's TCPStore binds no one address)."""
    _, port = split_host_port(addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore("0.0.0.0", port, size, True, timeout, wait_for_workers=False)


def join_rendezvous(
    addr: str, timeout_s: float, start_s: float | None = None, waiting: str | None = None
) -> dist.TCPStore:
    """Any other rank or node: a client of rank 0's rendezvous store at `addr`; its calls wait up to `timeout_s`. Until
    it listens (node 0 may start later) it waits quietly, polling with plain connections (a TCPStore
    client's own failed tries log a stack trace each), up to `start_s` (default `timeout_s`): `waiting`, if
    given, is logged once, and past the bound a UserError says what to do."""
    host, port = split_host_port(addr)
    deadline = time.monotonic() + (timeout_s if start_s is None else start_s)
    _wait_listening(host, port, deadline, waiting, addr)
    while True:
        try_s = max(0.1, min(CONNECT_TRY_S, deadline - time.monotonic()))
        try:
            rendezvous = dist.TCPStore(
                host, port, None, False, datetime.timedelta(seconds=try_s), wait_for_workers=False
            )
        except (RuntimeError, TimeoutError):  # not listening yet (torch.distributed.DistError)
            if time.monotonic() >= deadline:
                raise
            continue
        rendezvous.set_timeout(datetime.timedelta(seconds=timeout_s))  # how long a rank waits for the others
        return rendezvous


def _wait_listening(host: str, port: int, deadline: float, waiting: str | None, addr: str) -> None:
    said = False
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise UserError(
                f"nothing listens at --dist-init-addr {addr} after --dist-timeout: start node 0 (--node-rank 0) of "
                "the TP group with the same --dist-init-addr, or check that this node reaches it"
            )
        if waiting and not said:
            log.info("%s", waiting)
            said = True
        time.sleep(0.5)


def start_barrier(rendezvous: dist.Store, rank: int, size: int, timeout_s: float, per_node: int) -> None:
    """Every rank of the group has joined the `rendezvous` store, waited for at most `timeout_s` (--dist-timeout): past it a
    UserError names the ranks (and nodes) that did not join. Loading the model comes after, unbounded."""
    keys = [f"tandem/joined/{r}" for r in range(size)]
    rendezvous.set(keys[rank], "1")
    try:
        rendezvous.wait(keys, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError):  # torch.distributed.DistStoreError
        missing = [r for r in range(size) if not rendezvous.check([keys[r]])]
        nodes = sorted({r // per_node for r in missing})
        raise UserError(
            f"tp ranks {missing} (node {', '.join(map(str, nodes))}) did not join the TP group within --dist-timeout "
            f"{timeout_s:g} s: start every node (--node-rank 0..) with the same --tp-size, --nnodes and --dist-init-addr"
        ) from None


def init_group(
    rank: int, size: int, rendezvous: dist.Store, device: str, timeout_s: float, per_node: int
) -> TensorParallel:
    """Join the group of `size` ranks that meet in the `rendezvous` store (see serve_rendezvous / join_rendezvous); `per_node`
    ranks share this node: on CUDA the rank's index on its node picks its GPU."""
    extra = {}
    if device == "cuda":
        torch.cuda.set_device(rank % per_node)
        os.environ.setdefault(NCCL_ERROR_HANDLING_ENV, "0")  # the supervisor decides (see above)
        extra["device_id"] = torch.device("cuda", rank % per_node)  # the communicator is formed now
    else:  # the ranks share the cores: more threads each would spin against each other in every collective
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    dist.init_process_group(
        backend="nccl" if device == "cuda" else "gloo",
        store=rendezvous,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **extra,
    )
    _HOST_GROUP[:] = [dist.new_group(backend="gloo") if device == "cuda" else dist.group.WORLD]
    return TensorParallel(rank, size)
