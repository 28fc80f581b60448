"""KVManager: one per server process. Owns the transfer backend, the registered buffers, the ZMQ
control sockets, the table of rooms and the heartbeat. PrefillKVManager and DecodeKVManager add what
each role does with the messages it receives.

Threads: `kv-recv` reads control messages; `kv-heartbeat` pings peers (decode) and declares silent
peers dead (both roles); prefill adds one `kv-transfer` thread per decode peer. Errors end one room,
never a thread.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field

import zmq

from transfer.backends.base import make_backend
from transfer.liveness import Liveness
from transfer.messages import BadMessage, Request, decode, encode
from transfer.poll import PollState

log = logging.getLogger(__name__)


@dataclass
class KVArgs:
    kv_ptrs: list[int]  # all K layers, then all V layers
    kv_nbytes: list[int]
    bytes_per_page: list[int]
    num_pages: int
    page_size: int
    host: str = "127.0.0.1"
    backend: str = "mooncake"
    protocol: str = "tcp"
    device: str = ""
    on_cuda: bool = False
    secret: str | None = None
    aux_ptr: int = 0  # decode: where prefill writes aux records
    aux_record_bytes: int = 0
    aux_slots: int = 0
    kv_wait_timeout_s: float = 300.0
    transfer_timeout_s: float = 60.0
    heartbeat_interval_s: float = 5.0
    heartbeat_misses: int = 2


@dataclass
class RoomState:
    poll: PollState = field(default_factory=PollState)
    request: Request | None = None  # prefill: where the decode wants the KV
    peer: str | None = None  # decode: the prefill's control endpoint
    owned: bool = False  # a KVSender / KVReceiver of this process holds the room
    status_received: bool = False  # decode: the prefill's final word arrived; nothing more will land
    peer_dead: bool = False  # decode: the prefill was declared dead while this room waited on it
    created: float = field(default_factory=time.monotonic)


class KVManager(ABC):
    mode: str

    def __init__(self, args: KVArgs):
        self.args = args
        self.instance_id = f"{self.mode}-{uuid.uuid4().hex[:12]}"
        self.backend = make_backend(args.backend, args.host, args.protocol, args.device, args.transfer_timeout_s)
        for ptr, nbytes in zip(args.kv_ptrs, args.kv_nbytes):
            self.backend.register(ptr, nbytes, args.on_cuda)
        self.counters: Counter[str] = Counter()
        self.rooms: dict[int, RoomState] = {}
        self.liveness = Liveness(args.heartbeat_interval_s, args.heartbeat_misses)
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        port = self._pull.bind_to_random_port(f"tcp://{args.host}")
        self.endpoint = f"tcp://{args.host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._recv_loop, name="kv-recv", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="kv-heartbeat", daemon=True).start()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # -- control plane -------------------------------------------------------------------------
    def send(self, endpoint: str, msg: object) -> None:
        with self._lock:
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._push[endpoint] = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.SNDHWM, 100000)
                sock.connect(endpoint)
            try:
                sock.send(encode(msg, self.args.secret), flags=zmq.NOBLOCK)
            except zmq.Again:  # the peer stopped reading long ago; the heartbeat will say so
                self.counters["dropped_sends"] += 1

    def drop_socket(self, endpoint: str) -> None:
        with self._lock:
            sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self.stopped:
            if not poller.poll(100):
                continue
            raw = self._pull.recv()
            try:
                self.handle(decode(raw, self.args.secret))
            except BadMessage as e:
                self.counters["rejected_messages"] += 1
                log.warning("dropped a control message: %s", e)
            except Exception:
                self.counters["rejected_messages"] += 1
                log.exception("control message handler failed")

    @abstractmethod
    def handle(self, msg: object) -> None:
        """Act on one validated message; raise BadMessage for one this role does not accept."""

    # -- rooms ---------------------------------------------------------------------------------
    def claim(self, room: int) -> RoomState:
        """The room's state, marked as held by a sender/receiver of this process (atomically, so a
        concurrent abort cannot discard it as an orphan)."""
        with self._lock:
            state = self.rooms.setdefault(room, RoomState())
            state.owned = True
            return state

    def forget(self, room: int) -> None:
        with self._lock:
            self.rooms.pop(room, None)

    def rooms_snapshot(self) -> list[tuple[int, RoomState]]:
        with self._lock:
            return list(self.rooms.items())

    # -- heartbeat -----------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        interval = self.args.heartbeat_interval_s
        last_ping = 0.0
        while not self._stop.wait(min(interval / 4, 0.5)):
            try:
                watched = self.watched_peers()
                if time.monotonic() - last_ping >= interval:
                    last_ping = time.monotonic()
                    self.ping(watched)
                for peer, silent_s in self.liveness.silent(watched):
                    self.counters["peers_declared_dead"] += 1
                    self.declare_dead(peer, silent_s)
            except Exception:
                log.exception("heartbeat round failed")

    @abstractmethod
    def watched_peers(self) -> set[str]:
        """Peers that rooms of this process are waiting on right now."""

    def ping(self, peers: set[str]) -> None:
        """Send a heartbeat to each peer (decode does; prefill only listens)."""

    @abstractmethod
    def declare_dead(self, peer: str, silent_s: float) -> None:
        """Fail every room waiting on `peer`, silent for `silent_s` seconds."""

    def close(self) -> None:
        self._stop.set()
        time.sleep(0.2)
        self.backend.close()


def kv_args_from_pool(pool, config, aux_ptr: int = 0, aux_record_bytes: int = 0, aux_slots: int = 0) -> KVArgs:
    infos = pool.buffer_infos()
    return KVArgs(
        kv_ptrs=[i.data_ptr for i in infos], kv_nbytes=[i.nbytes for i in infos],
        bytes_per_page=[i.bytes_per_page for i in infos], num_pages=pool.num_pages, page_size=pool.page_size,
        host=config.public_host, backend=config.transfer_backend, protocol=config.transfer_protocol,
        device=config.transfer_device, on_cuda=config.device == "cuda", secret=config.cluster_secret,
        aux_ptr=aux_ptr, aux_record_bytes=aux_record_bytes, aux_slots=aux_slots, kv_wait_timeout_s=config.kv_wait_timeout_s,
        transfer_timeout_s=config.transfer_timeout_s, heartbeat_interval_s=config.heartbeat_interval_s,
        heartbeat_misses=config.heartbeat_misses,
    )
