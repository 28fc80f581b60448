"""KV cache events on the wire, as vLLM publishes them (`vllm/distributed/kv_events.py`), and their config.

A message is three ZMQ frames: topic, sequence number (8 bytes, big-endian), and a msgpack `EventBatch`.
vLLM defines its structs with msgspec, `array_like=True`, `omit_defaults=True`, the events a tagged union
(`tag=True`: the tag is the class name); encoded, that is positional arrays:

    EventBatch       [ts, [event, ...]]                   (+ data_parallel_rank when it is not None)
    BlockStored      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                      lora_name]
    BlockRemoved     ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared ["AllBlocksCleared"]

msgpack (plain lists) writes exactly those bytes, so a subscriber built on vLLM's msgspec structs decodes them
unchanged (tests/unit/test_kv_events.py does). A block is one page. Replay: a DEALER sends the first sequence
number it wants (8 bytes big-endian) to the ROUTER `replay_endpoint`; it gets (seq, payload) frames for every
buffered batch from there on, then (END_SEQ, b"").

Block hashes are chained as vLLM chains them: a page's hash digests its parent page's hash and its own token ids,
so equal hashes mean equal prefixes. The digest is SHA-256 over the parent's 32-byte digest (32 zero bytes for a
first page) and the page's token ids as 4-byte little-endian integers; on the wire each is the digest's low 64
bits as an unsigned integer (vLLM's `maybe_convert_block_hash` with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES). A first
page's `parent_block_hash` is None. `medium` is the tier ("GPU" the device pool, "CPU" the host tier: see
common/memory/cache_listener.py).

LoRA adapters (--enable-lora): a page computed under an adapter is only valid under it, so an adapter's chain starts
from its own root, the SHA-256 of "lora:" and the adapter's name (`adapter_root`), not from 32 zero bytes: the same
tokens under two adapters (or one and the base model) never share a hash, in the events, the router's index or the
KV store (common/memory/store/keys.py). The root digests the name, not a server's lora_id, because two servers may
number their adapters differently; as vLLM keys its block hashes by `lora_name`. BlockStored carries both: `lora_id`
(vLLM's deprecated field; this server's number of the adapter, None for the base model) and `lora_name`.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

END_SEQ = (-1).to_bytes(8, "big", signed=True)
ROOT_DIGEST = bytes(32)


class KVEventsConfig(BaseModel):
    """`--kv-events-config` JSON: vLLM's `KVEventsConfig` fields (SGLang takes the same JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = True
    publisher: Literal["zmq", "null"] = "zmq"
    endpoint: str = Field("tcp://*:5557", description="PUB address; `*` binds every interface, port `*` any port")
    replay_endpoint: str | None = Field(None, description="ROUTER address serving missed batches")
    buffer_steps: int = Field(10_000, ge=1, description="batches kept for replay")
    hwm: int = Field(100_000, ge=1, description="ZMQ high-water mark of the PUB socket")
    max_queue_size: int = Field(100_000, ge=1, description="events waiting for the publisher thread; more are dropped")
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """The config from the flag's JSON (None: events off); a bad field is a ValueError naming it."""
    if not text:
        return None
    try:
        config = KVEventsConfig.model_validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(the JSON)"
        raise ValueError(f"--kv-events-config: {where}: {first['msg']}") from None
    return config if config.enabled else None


def adapter_root(lora_name: str | None) -> bytes:
    """The digest an adapter's first page chains from (the base model's: 32 zero bytes)."""
    return hashlib.sha256(b"lora:" + lora_name.encode()).digest() if lora_name else ROOT_DIGEST


def page_digests(tokens: list[int], page_size: int, parent: bytes = ROOT_DIGEST) -> list[bytes]:
    """The chained SHA-256 digest of each whole page of `tokens`, the first page's parent being `parent`."""
    out = []
    for i in range(0, len(tokens) - page_size + 1, page_size):
        parent = hashlib.sha256(parent + struct.pack(f"<{page_size}i", *tokens[i : i + page_size])).digest()
        out.append(parent)
    return out


def external_hash(digest: bytes) -> int:
    """What the wire carries for a digest: its low 64 bits, unsigned."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def block_hashes(tokens: list[int], page_size: int, lora_name: str | None = None) -> list[int]:
    """The wire hashes of every whole page of a prompt, from its first token (under the adapter `lora_name`)."""
    return [external_hash(d) for d in page_digests(tokens, page_size, adapter_root(lora_name))]


def block_stored(
    hashes: list[int],
    parent: int | None,
    token_ids: list[int],
    page_size: int,
    medium: str,
    lora_id: int | None = None,
    lora_name: str | None = None,
) -> list[Any]:
    return ["BlockStored", hashes, parent, token_ids, page_size, lora_id, medium, lora_name]


def block_removed(hashes: list[int], medium: str) -> list[Any]:
    return ["BlockRemoved", hashes, medium]


def all_blocks_cleared() -> list[Any]:
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: list[list[Any]], data_parallel_rank: int | None = None) -> bytes:
    batch: list[Any] = [ts, events] if data_parallel_rank is None else [ts, events, data_parallel_rank]
    return msgpack.packb(batch, use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]]]:
    """(ts, events) of one batch; each event a list whose first item is its tag. ValueError if malformed."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        ts, events = float(batch[0]), batch[1]
        if not isinstance(events, list) or not all(isinstance(e, list) and e and isinstance(e[0], str) for e in events):
            raise ValueError("events is not a list of tagged arrays")
    except (TypeError, IndexError, ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"malformed KV event batch: {e}") from None
    return ts, events
