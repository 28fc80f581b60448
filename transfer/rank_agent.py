"""A follower rank's own KV transfer engine (a prefill or decode server at `--tp-size N`, ranks 1..N-1).

Every rank registers its own pool with its own engine (`make_backend` on its own device), so GPU memory
of one process, or of another host, is never registered by another. Rank 0 stays the only brain: it
learns each follower's engine address and pool from the start-up report (`RankTransferReport`) and keeps every
room, status and message of the control plane.

- On a decode, the agent is passive: the prefill writes into the pool it registered, one-sided.
- On a prefill, it also serves rank 0 (`serve`): a signed `RankWrite` (transfer.messages, the cluster
  secret, a replay guard, on its own ZMQ PULL socket on the server's public host) names the pieces of
  this rank's pool to write into one decode rank; the agent learns that peer on first use
  (`add_peer`), writes with its own engine on a worker thread (lowered, as every transfer thread), and
  answers `RankWritten` (bytes written, or why not) to rank 0's control endpoint. A piece outside the
  registered pool is refused, whoever signed it.

A write is bounded by the engine's own timeout (`--transfer-timeout-s`); when this process dies, rank 0
sees the follower exit (the TP group faults) and fails what waits on it (transfer.prefill.rank_links).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from transfer.backends.base import TransferBackend
from transfer.bulk_priority import lower_this_thread
from transfer.control_plane import ZmqControlPlane
from transfer.messages import BadMessage, RankWrite, RankWritten, ReplayGuard, open_frame

log = logging.getLogger(__name__)
WRITERS = 4  # rank slices of different decodes written at once (one slow decode does not hold the others)


@dataclass(frozen=True)
class RankTransferReport:
    """What rank 0's KV manager needs of a follower rank (sent in its start-up report): its engine's
    address, its pool, and, on a prefill, where its agent listens."""

    backend_address: bytes
    kv_ptr: int
    kv_nbytes: int
    bytes_per_page: int
    device_index: int  # the CUDA device its pool is on (0 on the CPU): NIXL names it on remote descriptors
    agent_endpoint: str | None  # None on a decode: its agent only registers the pool
    agent_id: str


class RankAgent:
    def __init__(
        self,
        backend: TransferBackend,
        buffer: tuple[int, int, int],
        on_device: bool,
        host: str,
        secret: str | None,
        serve: bool,
        device_index: int = 0,
    ):
        """`buffer`: (pointer, bytes, bytes per page) of this rank's pool, on CUDA device `device_index` when
        `on_device`; `serve`: a prefill's agent."""
        self.backend, self.secret, self.on_device = backend, secret, on_device
        self.device_index = device_index
        self.ptr, self.nbytes, self.bytes_per_page = buffer
        backend.register(self.ptr, self.nbytes, on_device)
        self.instance_id = f"rank-agent-{uuid.uuid4().hex[:12]}"
        self.counters: Counter[str] = Counter()
        self.peers: dict[str, tuple[bytes, int]] = {}
        self._lock = threading.Lock()
        self.control: ZmqControlPlane | None = None
        if serve:
            self.replay = ReplayGuard()
            self.writers = ThreadPoolExecutor(WRITERS, "rank-agent", initializer=lower_this_thread)
            self.control = ZmqControlPlane(host, self.instance_id, secret, self.counters)
            self.control.start(self.on_frame)

    def report(self) -> RankTransferReport:
        endpoint = self.control.endpoint if self.control else None
        return RankTransferReport(
            self.backend.address(),
            self.ptr,
            self.nbytes,
            self.bytes_per_page,
            self.device_index,
            endpoint,
            self.instance_id,
        )

    def on_frame(self, raw: bytes) -> None:
        try:
            msg, envelope = open_frame(raw, self.secret)
            self.replay.check(envelope)
            if not isinstance(msg, RankWrite):
                raise BadMessage(f"{type(msg).__name__} is not for a rank agent")
        except BadMessage as e:
            self.counters["rejected_messages"] += 1
            log.warning("rank agent dropped a message: %s", e)
            return
        self.writers.submit(self._write, msg)

    def _write(self, msg: RankWrite) -> None:
        try:
            self._check_source(msg)
            self._learn(msg.peer_id, msg.peer_address, msg.peer_device)
            self.backend.write_batch(msg.peer_id, msg.src, msg.dst, msg.nbytes, msg.on_device)
            reply = RankWritten(msg.job, True, "", sum(msg.nbytes))
            self.counters["bytes_sent"] += reply.written
        except Exception as e:  # the room fails on rank 0, naming this
            log.warning("rank agent: write of job %d to %s failed: %s", msg.job, msg.peer_id, e)
            reply = RankWritten(msg.job, False, f"{type(e).__name__}: {e}", 0)
        self.control.send(msg.reply_to, reply)

    def _check_source(self, msg: RankWrite) -> None:
        end = self.ptr + self.nbytes
        if any(not self.ptr <= s or s + n > end for s, n in zip(msg.src, msg.nbytes)):
            raise ValueError("a source piece lies outside this rank's registered KV pool")

    def _learn(self, peer_id: str, address: bytes, device: int) -> None:
        with self._lock:
            if self.peers.get(peer_id) != (address, device):
                self.backend.add_peer(peer_id, address, device)
                self.peers[peer_id] = (address, device)

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
            self.writers.shutdown(wait=False, cancel_futures=True)
        self.backend.close()
