"""KVManager: one per server process. Owns the transfer backend and its registered buffers, the
control plane, the replay guard and the heartbeat; PrefillKVManager and DecodeKVManager add their
room tables and what each role does with the messages it receives.

Threads (with threaded=True, the servers' mode): `kv-recv` reads control messages; `kv-heartbeat` pings
peers (decode) and declares silent peers dead (both roles); prefill adds one `kv-transfer` thread per
decode peer. An error ends one room or drops one message, never a thread. With threaded=False nothing
runs on its own: a test delivers frames with `on_frame`, ticks the heartbeat with `heartbeat_tick` and
runs transfer workers itself, on a clock it controls.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from transfer.backends.factory import make_backend
from transfer.backends.shared import SharedBackend
from transfer.bulk_priority import create_lowered
from transfer.control_plane import ZmqControlPlane
from transfer.liveness import Liveness
from transfer.messages import BadMessage, Envelope, ReplayGuard, open_frame
from transfer.metrics import TransferMetrics
from transfer.poll import PollState
from transfer.rank_agent import RankTransferReport

log = logging.getLogger(__name__)
ControlFactory = Callable[[str, Counter], Any]


class RoomState(Protocol):
    """Either side's state of one room (PrefillRoomState, DecodeRoomState)."""

    room_id: int
    poll: PollState


@dataclass
class KVArgs:
    kv_ptrs: list[int]  # the KV buffers, the same number per rank (a server's page-major pool: one), in rank
    # order; this process's engine registers rank 0's, each follower's own engine its own (transfer.rank_agent)
    kv_nbytes: list[int]
    bytes_per_page: list[int]
    num_pages: int
    page_size: int
    host: str = "127.0.0.1"
    backend: str = "mooncake"
    protocol: str = "tcp"
    device: str = ""
    on_cuda: bool = False
    device_index: int = 0  # the KV pool's CUDA device
    secret: str | None = None
    aux_ptr: int = 0  # decode: where prefill writes aux records
    aux_record_bytes: int = 0  # decode: one aux slot; prefill: the record it writes (0: not checked)
    aux_slots: int = 0
    kv_wait_timeout_s: float = 300.0
    transfer_timeout_s: float = 60.0
    heartbeat_interval_s: float = 5.0
    heartbeat_misses: int = 2
    max_queued_chunks: int = 4096  # prefill: chunks waiting per decode before a room fails
    tp_size: int = 1  # the ranks whose pools kv_ptrs are
    kv_heads: int = 1  # the model's KV heads, as the KV layout says (common.wire.kv_heads splits them)
    dp_size: int = 1  # attention DP ranks (DP attention): each of tp_size / dp_size ranks holds every KV head
    rank_addresses: list[bytes] = field(default_factory=list)  # followers' engines (ranks 1..), in rank order
    rank_device_indices: list[int] = field(default_factory=list)  # followers' CUDA devices (ranks 1..)
    rank_agents: list[tuple[str, str]] = field(default_factory=list)  # prefill: followers' (endpoint, agent id)
    kv_checksum: bool = False  # hash every page run (prefill) and verify it before Success (decode)


class KVManager(ABC):
    mode: str

    def __init__(
        self,
        args: KVArgs,
        control: ControlFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        threaded: bool = True,
        wake_scheduler: Callable[[], None] = lambda: None,
        shared: SharedBackend | None = None,
    ):
        """`control(instance_id, counters)` builds the control plane (default: ZMQ on args.host);
        `wake_scheduler` is the scheduler's wake, called from this manager's threads when a room may have
        moved (a message, a write's end, a peer declared dead), so no step waits on a timer; `shared`: the
        process's one transfer engine across role switches (transfer/backends/shared.py), else its own."""
        self.args = args
        self.instance_id = f"{self.mode}-{uuid.uuid4().hex[:12]}"
        self.clock, self.threaded = clock, threaded
        make = lambda: create_lowered(  # noqa: E731
            lambda: make_backend(
                args.backend,
                args.host,
                args.protocol,
                args.device,
                args.transfer_timeout_s,
                args.on_cuda,
                args.device_index,
            )
        )
        self.backend = shared.bind(make) if shared is not None else make()
        log.info("%s KV transfer: %s", self.mode, self.backend.describe())
        own = len(args.kv_ptrs) // args.tp_size  # rank 0's buffers (its pool: one) are ours
        for ptr, nbytes in zip(args.kv_ptrs[:own], args.kv_nbytes[:own]):
            self.backend.register(ptr, nbytes, args.on_cuda)
        self.counters: Counter[str] = Counter()
        self.metrics = TransferMetrics(self.counters)  # the engine's /metrics exposes it
        self.liveness = Liveness(args.heartbeat_interval_s, args.heartbeat_misses, clock, wall_clock)
        self.replay = ReplayGuard(clock=wall_clock)
        make = control or (
            lambda sender, counters: ZmqControlPlane(
                args.host, sender, args.secret, counters, stall_s=args.heartbeat_interval_s
            )
        )
        self.control = make(self.instance_id, self.counters)
        self.endpoint: str = self.control.endpoint
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._last_ping = float("-inf")
        self.wake_scheduler = wake_scheduler

    def start(self) -> None:
        """Connect the control plane to on_frame and, in threaded mode, start the heartbeat thread; the
        role's constructor calls this last."""
        self.control.start(self.on_frame)
        if self.threaded:
            self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="kv-heartbeat", daemon=True)
            self._heartbeat_thread.start()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # -- control plane -------------------------------------------------------------------------
    def send(self, endpoint: str, msg: object) -> None:
        self.control.send(endpoint, msg)

    def on_frame(self, raw: bytes) -> None:
        """Verify one received frame (signature, fields, replay) and act on it; a bad one is counted."""
        try:
            msg, envelope = open_frame(raw, self.args.secret)
            self.replay.check(envelope)
            self.handle(msg, envelope)
            self.wake_scheduler()
        except BadMessage as e:
            self.counters["rejected_messages"] += 1
            log.warning("dropped a control message: %s", e)

    @abstractmethod
    def handle(self, msg: object, envelope: Envelope) -> None:
        """Act on one verified message; raise BadMessage for one this role does not accept."""

    # -- rooms ---------------------------------------------------------------------------------
    def mark_failed(self, room: RoomState, reason: str, cause: str) -> bool:
        """Fail the room here, counted by `cause` (transfer.metrics.CAUSES), and wake the scheduler to end
        its request; False if it had already ended. (A prefill's fail_room also owes the decode a status.)"""
        if not room.poll.fail(reason):
            return False
        self.counters["rooms_failed"] += 1
        self.metrics.failed(cause)
        self.wake_scheduler()
        return True

    # -- heartbeat -----------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(min(self.args.heartbeat_interval_s / 4, 0.5)):
            try:
                self.heartbeat_tick()
            except Exception:  # one bad round must not stop the heartbeat for good
                log.exception("heartbeat round failed")

    def heartbeat_tick(self) -> None:
        """Ping the peers rooms wait on (every half interval) and declare the silent ones dead."""
        watched = self.watched_peers()
        if self.clock() - self._last_ping >= self.args.heartbeat_interval_s / 2:
            self._last_ping = self.clock()
            self.ping(watched)
        for peer, silent_s in self.liveness.silent(watched):
            self.counters["peers_declared_dead"] += 1
            self.declare_dead(peer, silent_s)
            self.wake_scheduler()

    @abstractmethod
    def watched_peers(self) -> list[str]:
        """Peers that rooms of this process are waiting on right now."""

    def ping(self, peers: list[str]) -> None:
        """Send a heartbeat to each peer (decode does; prefill only listens)."""

    @abstractmethod
    def declare_dead(self, peer: str, silent_s: float) -> None:
        """Fail every room waiting on `peer`, silent for `silent_s` seconds."""

    # -- health --------------------------------------------------------------------------------
    def health_problem(self) -> str | None:
        """Why this manager cannot do its job (a thread died), or None."""
        if not self.threaded or self.stopped:
            return None
        if not self.control.alive:
            return "the control-plane receive thread died"
        if self._heartbeat_thread is not None and not self._heartbeat_thread.is_alive():
            return "the heartbeat thread died"
        return None

    def close(self) -> None:
        self._stop.set()
        self.control.close()
        time.sleep(0.2)
        self.backend.close()


def kv_args_from_pool(
    pool,
    config,
    aux_ptr: int = 0,
    aux_record_bytes: int = 0,
    aux_slots: int = 0,
    kv_heads: int | None = None,
    followers: list[RankTransferReport] = (),
) -> KVArgs:
    """The transfer args of rank 0's pool and its `followers`' (their agents' reports, ranks 1..:
    transfer.rank_agent) of a model with `kv_heads` (default: the pool's, right at TP 1)."""
    (own,) = pool.buffer_infos()
    return KVArgs(
        kv_ptrs=[own.data_ptr, *(f.kv_ptr for f in followers)],
        kv_nbytes=[own.nbytes, *(f.kv_nbytes for f in followers)],
        bytes_per_page=[own.bytes_per_page, *(f.bytes_per_page for f in followers)],
        num_pages=pool.num_pages,
        page_size=pool.page_size,
        host=config.public_host,
        backend=config.transfer_backend,
        protocol=config.transfer_protocol,
        device=config.transfer_device,
        on_cuda=config.device == "cuda",
        device_index=pool.device_index,
        secret=config.cluster_secret,
        aux_ptr=aux_ptr,
        aux_record_bytes=aux_record_bytes,
        aux_slots=aux_slots,
        kv_wait_timeout_s=config.kv_wait_timeout_s,
        transfer_timeout_s=config.transfer_timeout_s,
        heartbeat_interval_s=config.heartbeat_interval_s,
        heartbeat_misses=config.heartbeat_misses,
        tp_size=config.tp_size,
        kv_heads=kv_heads or pool.kv_heads,
        dp_size=config.dp_size,
        rank_addresses=[f.backend_address for f in followers],
        rank_device_indices=[f.device_index for f in followers],
        rank_agents=[(f.agent_endpoint, f.agent_id) for f in followers if f.agent_endpoint],
        kv_checksum=config.disaggregation_enable_kv_checksum,
    )
