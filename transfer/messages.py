"""Control-plane messages (msgpack over ZMQ). Every field is checked on receipt; a message that does
not parse, or whose signature does not match the cluster secret, raises BadMessage and is dropped
and counted.

    decode -> prefill  register  once per (decode instance, prefill): where to write and how to reach it
    decode -> prefill  request   per room: destination pages and aux slot
    decode -> prefill  abort     per room: stop sending (prefill answers with a status once no write is in flight)
    decode -> prefill  ping      every heartbeat interval, to each prefill it waits on
    prefill -> decode  pong      the answer to a ping
    prefill -> decode  status    per room: ok or failed(reason), after the last write of that room

Frame: msgpack [body, mac]; mac = HMAC-SHA256(cluster secret, body), empty without a secret, so the
secret itself never crosses the wire.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import asdict, dataclass
from typing import Any

import msgpack

MAX_PAGES_PER_REQUEST = 1 << 22
MAX_FRAME_BYTES = 64 << 20


class BadMessage(ValueError):
    pass


@dataclass
class Register:
    decode_id: str
    status_endpoint: str
    backend_address: bytes
    kv_ptrs: list[int]
    bytes_per_page: list[int]
    num_pages: int
    page_size: int
    aux_ptr: int
    aux_record_bytes: int
    aux_slots: int


@dataclass
class Request:
    room: int
    decode_id: str
    dst_pages: list[int]
    aux_slot: int


@dataclass
class Abort:
    room: int
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
    room: int
    ok: bool
    reason: str


KINDS = {"register": Register, "request": Request, "abort": Abort, "ping": Ping, "pong": Pong, "status": Status}
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "decode_id": (str,), "status_endpoint": (str,), "backend_address": (bytes,), "kv_ptrs": (list,),
    "bytes_per_page": (list,), "num_pages": (int,), "page_size": (int,), "aux_ptr": (int,),
    "aux_record_bytes": (int,), "aux_slots": (int,), "room": (int,), "dst_pages": (list,),
    "aux_slot": (int,), "reason": (str,), "ok": (bool,), "endpoint": (str,),
}


def _mac(body: bytes, secret: str | None) -> bytes:
    return hmac.new(secret.encode(), body, hashlib.sha256).digest() if secret else b""


def encode(msg: Any, secret: str | None) -> bytes:
    kind = next(k for k, cls in KINDS.items() if isinstance(msg, cls))
    body = msgpack.packb({"type": kind, **asdict(msg)}, use_bin_type=True)
    return msgpack.packb([body, _mac(body, secret)], use_bin_type=True)


def decode(raw: bytes, secret: str | None) -> Any:
    body = _verified_body(raw, secret)
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types for garbage
        raise BadMessage(f"body is not msgpack: {type(e).__name__}") from None
    if not isinstance(data, dict) or data.get("type") not in KINDS:
        raise BadMessage("not a known message type")
    cls = KINDS[data.pop("type")]
    fields = cls.__dataclass_fields__
    if set(data) != set(fields):
        raise BadMessage(f"{cls.__name__} fields {sorted(map(str, data))} != {sorted(fields)}")
    for name, value in data.items():
        if not isinstance(value, FIELD_TYPES[name]) or (FIELD_TYPES[name] == (int,) and isinstance(value, bool)):
            raise BadMessage(f"{cls.__name__}.{name} has type {type(value).__name__}")
    msg = cls(**data)
    _check_ranges(msg)
    return msg


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
    if secret is not None and not hmac.compare_digest(mac, _mac(body, secret)):
        raise BadMessage("wrong or missing cluster secret")
    return body


def _check_ranges(msg: Any) -> None:
    if isinstance(msg, (Request, Abort, Status)) and not 0 <= msg.room < 2**63:
        raise BadMessage("room out of range")
    if isinstance(msg, Request):
        if len(msg.dst_pages) > MAX_PAGES_PER_REQUEST or not all(type(p) is int for p in msg.dst_pages):
            raise BadMessage("dst_pages must be a list of ints")
    if isinstance(msg, Register):
        ints = msg.kv_ptrs + msg.bytes_per_page
        if not msg.kv_ptrs or len(msg.kv_ptrs) != len(msg.bytes_per_page) or not all(type(x) is int and x > 0 for x in ints):
            raise BadMessage("kv_ptrs / bytes_per_page must be matching lists of positive ints")
        if min(msg.num_pages, msg.page_size, msg.aux_record_bytes, msg.aux_slots) < 1 or msg.aux_ptr <= 0:
            raise BadMessage("register sizes must be positive")
