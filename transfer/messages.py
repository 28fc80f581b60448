"""Control-plane messages (msgpack over ZMQ). Every field is checked on receipt; a message that does
not parse, or whose signature does not match the cluster secret, raises BadMessage and is dropped
and counted.

    decode -> prefill  register  once per (decode instance, prefill): where to write and how to reach it
    decode -> prefill  request   per room: destination pages, aux slot, and the page-aligned prompt prefix the
                                 decode holds already (cached_prefix_len): the pages are for the prompt from there
    decode -> prefill  abort     per room: stop sending (prefill answers with a status once no write is in flight)
    decode -> prefill  ping      every heartbeat interval, to each prefill it waits on
    prefill -> decode  pong         the answer to a ping
    prefill -> decode  first_token  per room: its aux record (first sampled token), once the last chunk is queued,
                                    ahead of the KV
    prefill -> decode  status       per room: ok or failed(reason), after the last write of that room; ok
                                    carries the page runs' checksums with --disaggregation-enable-kv-checksum
    prefill -> decode  checksums    per chunk but the last (with that flag): its page runs' checksums, once it landed
    prefill rank 0 -> its follower's agent  rank_write    one rank slice of a chunk, written by that rank's
                                                          own engine (transfer.rank_agent)
    agent -> prefill rank 0                 rank_written  ok (bytes written) or failed(reason)

Frame: msgpack [body, mac]; mac = HMAC-SHA256(cluster secret, body), empty without a secret, so the
secret itself never crosses the wire. The signed body carries an envelope: the sender's instance id, a
sequence number that grows with every frame the sender sends, and the wall-clock send time. A receiver
drops a frame whose sequence number it has seen from that sender already (a replay), or that was sent
outside REPLAY_WINDOW_S of its own clock (a replay of a sender it has forgotten, or clocks out of sync).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

MAX_PAGES_PER_REQUEST = 1 << 22
MAX_FRAME_BYTES = 64 << 20
MAX_DEVICE_INDEX = 1 << 16
REPLAY_WINDOW_S = 300.0  # a frame older (or newer) than this by the receiver's clock is dropped
MAX_SENDERS_REMEMBERED = 65536
ENVELOPE = ("sender", "seq", "sent_at")


class BadMessage(ValueError):
    pass


@dataclass
class Register:
    decode_id: str
    status_endpoint: str
    backend_addresses: list[bytes]  # each rank's transfer engine, in rank order (one per KV buffer)
    kv_ptrs: list[int]
    bytes_per_page: list[int]
    num_pages: int
    page_size: int
    aux_ptr: int
    aux_record_bytes: int
    aux_slots: int
    tp_size: int = 1  # the decode's ranks: one KV buffer each, in rank order
    kv_heads: int = 1  # the model's KV heads (the layout's), split or replicated over the ranks
    device_indices: list[int] = field(default_factory=lambda: [0])  # each rank's CUDA device (0 on the CPU)
    dp_size: int = 1  # attention DP ranks: each holds tp_size / dp_size ranks' buffers, every KV head among them


@dataclass
class RoomRequest:
    room_id: int
    decode_id: str
    dst_pages: list[int]  # for the prompt's pages from cached_prefix_len on
    aux_slot: int
    cached_prefix_len: int = 0  # prompt tokens whose KV the decode has (its prefix cache): not sent
    dp_rank: int = 0  # the decode's DP rank whose pool dst_pages are (DP attention; 0 otherwise)
    lora: str = ""  # the LoRA adapter the decode runs the request under ("": the base model); the prefill's must match


@dataclass
class Abort:
    room_id: int
    decode_id: str
    reason: str


@dataclass
class Ping:
    decode_id: str


@dataclass
class Pong:
    endpoint: str  # the prefill's control endpoint, which is how decode names it


@dataclass
class Status:
    room_id: int
    ok: bool
    reason: str
    checksums: list = field(default_factory=list)  # [buffer, first dst page, pages, xxh3-64] (transfer/checksum.py)


@dataclass
class KVChecksums:
    """A chunk's page-run checksums (transfer/checksum.py), sent once its write landed; the last chunk's
    ride the room's final status."""

    room_id: int
    checksums: list


@dataclass
class FirstToken:
    """The room's aux record (first sampled token), sent as soon as it is known, ahead of the KV: the
    decode may stream the token before the pages land; the same record still comes with the KV."""

    room_id: int
    record: bytes


@dataclass
class RankWrite:
    """Prefill rank 0 to a follower's agent: write these pieces of the follower's pool into a decode
    rank (`peer_id`, reached at `peer_address`) with the follower's engine, then answer `reply_to`."""

    job: int
    peer_id: str
    peer_address: bytes
    peer_device: int  # the decode rank's CUDA device, as its Register said
    src: list[int]
    dst: list[int]
    nbytes: list[int]
    on_device: bool
    reply_to: str


@dataclass
class RankWritten:
    """A follower's agent to prefill rank 0: the rank slice `job` landed (`written` bytes), or why not."""

    job: int
    ok: bool
    reason: str
    written: int


KINDS = {
    "register": Register,
    "request": RoomRequest,
    "abort": Abort,
    "ping": Ping,
    "pong": Pong,
    "status": Status,
    "first_token": FirstToken,
    "checksums": KVChecksums,
    "rank_write": RankWrite,
    "rank_written": RankWritten,
}
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "decode_id": (str,),
    "status_endpoint": (str,),
    "backend_addresses": (list,),
    "kv_ptrs": (list,),
    "bytes_per_page": (list,),
    "num_pages": (int,),
    "page_size": (int,),
    "aux_ptr": (int,),
    "aux_record_bytes": (int,),
    "aux_slots": (int,),
    "tp_size": (int,),
    "kv_heads": (int,),
    "dp_size": (int,),
    "dp_rank": (int,),
    "device_indices": (list,),
    "peer_device": (int,),
    "room_id": (int,),
    "dst_pages": (list,),
    "aux_slot": (int,),
    "cached_prefix_len": (int,),
    "lora": (str,),
    "reason": (str,),
    "ok": (bool,),
    "endpoint": (str,),
    "record": (bytes,),
    "job": (int,),
    "peer_id": (str,),
    "peer_address": (bytes,),
    "src": (list,),
    "dst": (list,),
    "nbytes": (list,),
    "on_device": (bool,),
    "reply_to": (str,),
    "written": (int,),
    "checksums": (list,),
}


def _frame_mac(body: bytes, secret: str | None) -> bytes:
    return hmac.new(secret.encode(), body, hashlib.sha256).digest() if secret else b""


@dataclass(frozen=True)
class Envelope:
    sender: str  # the instance id of the sending KVManager
    seq: int  # grows with every frame this sender sends
    sent_at: float  # the sender's wall clock (time.time())


_PROCESS_SENDER = f"process-{uuid.uuid4().hex[:12]}"
_SEQ = itertools.count(1)


def encode(
    msg: Any, secret: str | None, sender: str | None = None, seq: int | None = None, sent_at: float | None = None
) -> bytes:
    """A signed frame. A message naming its decode (decode_id) is sent by that decode unless `sender`
    says otherwise; `seq` defaults to this process's next sequence number, `sent_at` to now."""
    kind = next(k for k, cls in KINDS.items() if isinstance(msg, cls))
    sender = sender or getattr(msg, "decode_id", None) or _PROCESS_SENDER
    envelope = {
        "sender": sender,
        "seq": next(_SEQ) if seq is None else seq,
        "sent_at": time.time() if sent_at is None else sent_at,
    }
    body = msgpack.packb({"type": kind, **asdict(msg), **envelope}, use_bin_type=True)
    return msgpack.packb([body, _frame_mac(body, secret)], use_bin_type=True)


def next_seq() -> int:
    return next(_SEQ)


def decode(raw: bytes, secret: str | None) -> Any:
    """The message of a signed frame (its envelope checked for shape, not for replay)."""
    return open_frame(raw, secret)[0]


def open_frame(raw: bytes, secret: str | None) -> tuple[Any, Envelope]:
    """(message, envelope) of a frame whose signature, fields and ranges are valid; else BadMessage."""
    body = _verified_body(raw, secret)
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types for garbage
        raise BadMessage(f"body is not msgpack: {type(e).__name__}") from None
    if not isinstance(data, dict) or data.get("type") not in KINDS:
        raise BadMessage("not a known message type")
    cls = KINDS[data.pop("type")]
    envelope = {k: data.pop(k) for k in ENVELOPE if k in data}
    fields = cls.__dataclass_fields__
    if set(data) != set(fields):
        missing, extra = sorted(set(fields) - set(data)), sorted(map(str, set(data) - set(fields)))
        raise BadMessage(
            f"{cls.__name__} fields {sorted(map(str, data))} != {sorted(fields)} (missing {missing}, "
            f"unexpected {extra}: a peer of another Tandem version? run one version on both)"
        )
    for name, value in data.items():
        if not isinstance(value, FIELD_TYPES[name]) or (FIELD_TYPES[name] == (int,) and isinstance(value, bool)):
            raise BadMessage(f"{cls.__name__}.{name} has type {type(value).__name__}")
    msg = cls(**data)
    _check_ranges(msg)
    return msg, _check_envelope(envelope)


def _check_envelope(e: dict[str, Any]) -> Envelope:
    sender, seq, sent_at = e.get("sender"), e.get("seq"), e.get("sent_at")
    if not isinstance(sender, str) or not 0 < len(sender) <= 128:
        raise BadMessage("envelope: sender must be a non-empty string")
    if type(seq) is not int or not 0 <= seq < 2**63:
        raise BadMessage("envelope: seq must be an int in [0, 2**63)")
    if not isinstance(sent_at, float) or sent_at != sent_at:
        raise BadMessage("envelope: sent_at must be a float")
    return Envelope(sender, seq, sent_at)


class ReplayGuard:
    """Accepts each (sender, seq) once, in increasing order per sender, within REPLAY_WINDOW_S."""

    def __init__(self, window_s: float = REPLAY_WINDOW_S, clock=time.time):
        self.window_s, self.clock = window_s, clock
        self._last: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, e: Envelope) -> None:
        skew = self.clock() - e.sent_at
        if abs(skew) > self.window_s:
            raise BadMessage(
                f"frame from {e.sender} sent {skew:.0f} s from now (a replay, or clocks out of sync "
                f"by more than {self.window_s:.0f} s)"
            )
        with self._lock:
            last = self._last.get(e.sender, -1)
            if e.seq <= last:
                raise BadMessage(f"frame {e.seq} from {e.sender} replayed (already saw {last})")
            self._last[e.sender] = e.seq
            self._last.move_to_end(e.sender)
            if len(self._last) > MAX_SENDERS_REMEMBERED:
                self._last.popitem(last=False)


def _verified_body(raw: bytes, secret: str | None) -> bytes:
    if len(raw) > MAX_FRAME_BYTES:
        raise BadMessage(f"frame of {len(raw)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        frame = msgpack.unpackb(raw, raw=False)
    except Exception as e:
        raise BadMessage(f"not msgpack: {type(e).__name__}") from None
    if not (isinstance(frame, list) and len(frame) == 2 and all(isinstance(x, bytes) for x in frame)):
        raise BadMessage("not a [body, mac] frame")
    body, mac = frame
    if secret is not None and not hmac.compare_digest(mac, _frame_mac(body, secret)):
        raise BadMessage("wrong or missing cluster secret")
    return body


def _check_ranges(msg: Any) -> None:
    if isinstance(msg, (RoomRequest, Abort, Status, FirstToken, KVChecksums)) and not 0 <= msg.room_id < 2**63:
        raise BadMessage("room out of range")
    if isinstance(msg, (RankWrite, RankWritten)) and not 0 <= msg.job < 2**63:
        raise BadMessage("job out of range")
    if isinstance(msg, (Status, KVChecksums)) and not all(
        isinstance(e, list) and len(e) == 4 and all(type(x) is int and 0 <= x < 2**64 for x in e) for e in msg.checksums
    ):
        raise BadMessage("status checksums must be [buffer, page, pages, hash] lists of non-negative ints")
    if isinstance(msg, RoomRequest):
        if len(msg.dst_pages) > MAX_PAGES_PER_REQUEST or not all(type(p) is int for p in msg.dst_pages):
            raise BadMessage("dst_pages must be a list of ints")
        if not 0 <= msg.cached_prefix_len < 2**40:
            raise BadMessage("cached_prefix_len out of range")
        if not 0 <= msg.dp_rank < 2**16:
            raise BadMessage("dp_rank out of range")
        if len(msg.lora) > 256:
            raise BadMessage("lora longer than 256 characters")
    if isinstance(msg, Register):
        ints = msg.kv_ptrs + msg.bytes_per_page
        if (
            not msg.kv_ptrs
            or len(msg.kv_ptrs) != len(msg.bytes_per_page)
            or not all(type(x) is int and x > 0 for x in ints)
        ):
            raise BadMessage("kv_ptrs / bytes_per_page must be matching lists of positive ints")
        sizes = (
            msg.num_pages,
            msg.page_size,
            msg.aux_record_bytes,
            msg.aux_slots,
            msg.tp_size,
            msg.kv_heads,
            msg.dp_size,
        )
        if min(sizes) < 1 or msg.aux_ptr <= 0:
            raise BadMessage("register sizes must be positive")
        if msg.tp_size % msg.dp_size:
            raise BadMessage(f"dp_size {msg.dp_size} must divide tp_size {msg.tp_size}")
        if len(msg.backend_addresses) != msg.tp_size or not all(
            isinstance(a, bytes) and a for a in msg.backend_addresses
        ):
            raise BadMessage("backend_addresses: one non-empty address per rank (tp_size)")
        if len(msg.device_indices) != msg.tp_size or not all(
            type(d) is int and 0 <= d < MAX_DEVICE_INDEX for d in msg.device_indices
        ):
            raise BadMessage("device_indices: one device index per rank (tp_size)")
    if isinstance(msg, RankWrite):
        if not 0 <= msg.peer_device < MAX_DEVICE_INDEX:
            raise BadMessage("rank_write: peer_device out of range")
        pieces = (msg.src, msg.dst, msg.nbytes)
        if len({len(x) for x in pieces}) != 1 or not all(type(x) is int and x > 0 for xs in pieces for x in xs):
            raise BadMessage("rank_write: src, dst and nbytes must be matching lists of positive ints")
