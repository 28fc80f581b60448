"""KVManager: one per server process. Owns the transfer backend, the registered buffers, a ZMQ PULL
socket for control messages and (prefill) the transfer worker thread.

Threads: `recv` reads control messages and updates room state; `transfer` (prefill) executes queued
chunks so the scheduler's next forward overlaps the copy. Errors end one room, never a thread.
"""
from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import zmq

from transfer.backends.base import make_backend
from transfer.messages import Abort, BadMessage, Register, Request, Status, decode, encode
from transfer.poll import KVPoll, PollState
from transfer.runs import chunk_triples

log = logging.getLogger(__name__)
PENDING_TTL_S = 600.0
MAX_PIECES_PER_BATCH = 1024  # Mooncake's TCP transport fails on much larger batches of small pieces


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


@dataclass
class RoomState:
    poll: PollState = field(default_factory=PollState)
    request: Request | None = None  # prefill: what decode asked for
    created: float = field(default_factory=time.monotonic)


class KVManager:
    def __init__(self, args: KVArgs, mode: str):
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be prefill or decode, not {mode!r}")
        self.args, self.mode = args, mode
        self.instance_id = f"{mode}-{uuid.uuid4().hex[:12]}"
        self.backend = make_backend(args.backend, args.host, args.protocol, args.device)
        for ptr, nbytes in zip(args.kv_ptrs, args.kv_nbytes):
            self.backend.register(ptr, nbytes, args.on_cuda)
        self.aux_staging = (ctypes.c_uint8 * max(args.aux_record_bytes, 4096))()
        if mode == "decode":
            self.backend.register(args.aux_ptr, args.aux_record_bytes * args.aux_slots)
        else:
            self.backend.register(ctypes.addressof(self.aux_staging), len(self.aux_staging))
        self.counters: Counter[str] = Counter()
        self.rooms: dict[int, RoomState] = {}
        self.peers: dict[str, Register] = {}  # prefill: decode instances that registered
        self.registered_with: set[str] = set()  # decode: prefill endpoints we registered with
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        port = self._pull.bind_to_random_port(f"tcp://{args.host}")
        self.endpoint = f"tcp://{args.host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._stop = False
        self.chunks: queue.Queue = queue.Queue()
        threading.Thread(target=self._recv_loop, name="kv-recv", daemon=True).start()
        if mode == "prefill":
            threading.Thread(target=self._transfer_loop, name="kv-transfer", daemon=True).start()

    # -- control plane -------------------------------------------------------------------------
    def send(self, endpoint: str, msg: object) -> None:
        with self._lock:
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._push[endpoint] = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.SNDHWM, 100000)
                sock.connect(endpoint)
            sock.send(encode(msg, self.args.secret), flags=zmq.NOBLOCK)

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop:
            if not poller.poll(100):
                continue
            raw = self._pull.recv()
            try:
                self._handle(decode(raw, self.args.secret))
            except BadMessage as e:
                self.counters["rejected_messages"] += 1
                log.warning("dropped a control message: %s", e)
            except Exception:
                self.counters["rejected_messages"] += 1
                log.exception("control message handler failed")

    def _handle(self, msg: object) -> None:
        if self.mode == "prefill" and isinstance(msg, Register):
            self.backend.add_peer(msg.decode_id, msg.backend_address)
            self.peers[msg.decode_id] = msg
        elif self.mode == "prefill" and isinstance(msg, Request):
            self._on_request(msg)
        elif self.mode == "prefill" and isinstance(msg, Abort):
            room = self.rooms.get(msg.room)
            if room is None:
                raise BadMessage(f"abort for unknown room {msg.room}")
            room.poll.fail(f"decode aborted: {msg.reason}")
        elif self.mode == "decode" and isinstance(msg, Status):
            room = self.rooms.get(msg.room)
            if room is None:
                raise BadMessage(f"status for unknown room {msg.room}")
            room.poll.advance(KVPoll.Success) if msg.ok else room.poll.fail(msg.reason)
        else:
            raise BadMessage(f"{type(msg).__name__} is not for a {self.mode} server")

    def _on_request(self, req: Request) -> None:
        peer = self.peers.get(req.decode_id)
        if peer is None:
            raise BadMessage(f"request from unregistered decode {req.decode_id}")
        if any(not 1 <= p <= peer.num_pages for p in req.dst_pages) or not 0 <= req.aux_slot < peer.aux_slots:
            raise BadMessage(f"room {req.room}: destination page or aux slot outside the decode's pool")
        self._expire_pending()
        with self._lock:
            room = self.rooms.setdefault(req.room, RoomState())
            if room.request is not None:
                raise BadMessage(f"room {req.room} was requested twice")
            room.request = req

    def _expire_pending(self) -> None:
        now = time.monotonic()
        with self._lock:
            for r, st in list(self.rooms.items()):
                if st.poll.done or now - st.created > PENDING_TTL_S:
                    if st.poll.done or st.request is not None:
                        del self.rooms[r]

    def room(self, room: int) -> RoomState:
        with self._lock:
            return self.rooms.setdefault(room, RoomState())

    def forget(self, room: int) -> None:
        with self._lock:
            self.rooms.pop(room, None)

    # -- data plane (prefill) ------------------------------------------------------------------
    def _transfer_loop(self) -> None:
        backlog: list[tuple] = []
        while not self._stop:
            try:
                item = backlog.pop(0) if backlog else self.chunks.get(timeout=0.1)
            except queue.Empty:
                continue
            room_id, state, src_pages, dst_pages, aux = self._merge_queued(item, backlog)
            if state.poll.done:
                continue  # failed or aborted: drop the rest of its chunks
            try:
                self._write_chunk(state.request, src_pages, dst_pages, aux)
            except Exception as e:
                log.warning("room %d: transfer failed: %s", room_id, e)
                self._fail_room(room_id, state, f"transfer error: {e}")
                continue
            if aux is not None:
                state.poll.advance(KVPoll.Success)
                self._send_status(state.request, Status(room_id, True, ""))

    def _merge_queued(self, item: tuple, backlog: list[tuple]) -> tuple:
        """Chunks of one room that queued up while the previous copy ran go out as one batch, so
        runs that continue across chunk boundaries become single pieces."""
        room_id, state, src, dst, aux = item
        while aux is None:
            try:
                nxt = self.chunks.get_nowait()
            except queue.Empty:
                break
            if nxt[0] != room_id:
                backlog.append(nxt)
                break
            src, dst, aux = src + nxt[2], dst + nxt[3], nxt[4]
        return room_id, state, src, dst, aux

    def _write_chunk(self, req: Request, src_pages: list[int], dst_pages: list[int], aux: bytes | None) -> None:
        peer = self.peers[req.decode_id]
        a = self.args
        src, dst, nbytes = chunk_triples(a.kv_ptrs, peer.kv_ptrs, a.bytes_per_page, src_pages, dst_pages)
        for i in range(0, len(src), MAX_PIECES_PER_BATCH):
            end = i + MAX_PIECES_PER_BATCH
            self.backend.write_batch(req.decode_id, src[i:end], dst[i:end], nbytes[i:end], a.on_cuda)
        if aux is not None:
            if len(aux) != peer.aux_record_bytes:
                raise ValueError(f"aux record of {len(aux)} bytes, decode expects {peer.aux_record_bytes}")
            ctypes.memmove(self.aux_staging, aux, len(aux))
            dst_aux = peer.aux_ptr + req.aux_slot * peer.aux_record_bytes
            self.backend.write_batch(req.decode_id, [ctypes.addressof(self.aux_staging)], [dst_aux], [len(aux)])

    def _fail_room(self, room_id: int, state: RoomState, reason: str) -> None:
        if state.poll.fail(reason) and state.request is not None:
            self._send_status(state.request, Status(room_id, False, reason))

    def _send_status(self, req: Request, status: Status) -> None:
        peer = self.peers.get(req.decode_id)
        if peer is not None:
            self.send(peer.status_endpoint, status)

    def close(self) -> None:
        self._stop = True
        time.sleep(0.2)
        self.backend.close()


def kv_layout(pool, backend: str) -> dict:
    """What decode and prefill must agree on before any byte moves."""
    return {"num_layers": pool.num_layers, "kv_heads": pool.kv_heads, "head_dim": pool.head_dim,
            "dtype": str(pool.dtype).removeprefix("torch."), "page_size": pool.page_size, "transfer_backend": backend}


def kv_args_from_pool(pool, config, aux_ptr: int = 0, aux_record_bytes: int = 0, aux_slots: int = 0) -> KVArgs:
    infos = pool.buffer_infos()
    return KVArgs(
        kv_ptrs=[i.data_ptr for i in infos], kv_nbytes=[i.nbytes for i in infos],
        bytes_per_page=[i.bytes_per_page for i in infos], num_pages=pool.num_pages, page_size=pool.page_size,
        host=config.public_host, backend=config.transfer_backend, protocol=config.transfer_protocol,
        device=config.transfer_device, on_cuda=config.device == "cuda", secret=config.cluster_secret,
        aux_ptr=aux_ptr, aux_record_bytes=aux_record_bytes, aux_slots=aux_slots, kv_wait_timeout_s=config.kv_wait_timeout_s,
    )
