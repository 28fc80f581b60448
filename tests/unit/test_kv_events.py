"""KV cache events: a radix cache's changes, published over real ZMQ sockets on 127.0.0.1, decoded by a
subscriber written from vLLM's published schema (msgspec structs as vllm/distributed/kv_events.py defines them:
array_like, omit_defaults, a tagged union), each tier's with its medium, replayed after a missed range, and dropped (counted) when full."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq

from common.core.request import LORA_KEY_STRIDE
from common.engine.kv_event_publisher import KVEventPublisher
from common.memory.allocator import PagedAllocator
from common.memory.hicache import HiRadixCache
from common.memory.host_pool import HostPool
from common.memory.radix_cache import RadixCache
from common.wire.kv_events import END_SEQ, KVEventsConfig, block_hashes, parse_kv_events_config

PAGE = 4
ExternalBlockHash = bytes | int


# -- vLLM's schema, as vLLM defines it -----------------------------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


# -- helpers -------------------------------------------------------------------------------------------
@pytest.fixture
def publisher():
    config = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv")
    pub = KVEventPublisher(config, PAGE, "127.0.0.1")
    yield pub
    pub.close()


def subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    time.sleep(0.3)  # ZMQ's slow joiner: a PUB drops what it sends before the subscription arrives
    return sub


def receive(sub: zmq.Socket, clears: int) -> list[tuple[int, KVEventBatch]]:
    """(seq, batch) received until `clears` AllBlocksCleared events arrived."""
    got = []
    while sub.poll(5000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        if sum(isinstance(e, AllBlocksCleared) for _, b in got for e in b.events) == clears:
            return got
    raise AssertionError(f"not {clears} AllBlocksCleared within 5 s; got {got}")


def cache_with(pub: KVEventPublisher) -> RadixCache:
    return RadixCache(PagedAllocator(64, PAGE), PAGE, pub)


def insert(cache: RadixCache, tokens: list[int]) -> None:
    slots = cache.allocator.alloc_token_slots(0, len(tokens), -1)
    cache.cache_finished_req(tokens, slots, None)


# -- tests ---------------------------------------------------------------------------------------------
def test_vllm_subscriber_decodes_stored_removed_and_cleared_with_chained_hashes(publisher):
    ctx = zmq.Context()
    sub = subscribe(ctx, publisher.endpoint)
    cache = cache_with(publisher)
    a = list(range(100, 112))  # 3 pages
    b = a[:8] + [7, 7, 7, 7, 9, 9]  # shares 2 pages, then 1 page of its own and a partial one
    insert(cache, a)
    insert(cache, b)
    cache.evict(64)
    cache.reset()
    got = receive(sub, 2)  # the new cache's, and reset's
    assert [seq for seq, _ in got] == list(range(got[0][0], got[0][0] + len(got)))  # numbered in order
    events = [e for _, batch in got for e in batch.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [s.token_ids for s in stored] == [a, b[8:12]]
    assert stored[0].block_hashes == block_hashes(a, PAGE) and stored[0].parent_block_hash is None
    assert stored[1].block_hashes == block_hashes(b, PAGE)[2:3]
    assert stored[1].parent_block_hash == block_hashes(a, PAGE)[1]  # chained: b's page 3 hangs off a's page 2
    assert all(s.block_size == PAGE and s.medium == "GPU" and s.lora_id is None for s in stored)
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed == set(block_hashes(a, PAGE)) | set(block_hashes(b, PAGE)[2:3])  # every page evicted
    assert isinstance(events[-1], AllBlocksCleared)
    sub.close(linger=0)
    ctx.term()


def test_an_adapters_pages_are_hashed_from_its_name_and_carry_lora_id_and_lora_name():
    """The same tokens cached under adapter "a" (lora_id 2 here), then the base model: "a"'s BlockStored hashes
    them from its own root, gives its real token ids, lora_id 2 and lora_name "a"; the base model's hashes differ."""
    config = KVEventsConfig(endpoint="tcp://127.0.0.1:*", topic="kv")
    publisher = KVEventPublisher(config, PAGE, "127.0.0.1", {2: "a"}.get)
    ctx = zmq.Context()
    sub = subscribe(ctx, publisher.endpoint)
    cache = cache_with(publisher)
    a = list(range(100, 108))
    insert(cache, [t + 2 * LORA_KEY_STRIDE for t in a])
    insert(cache, a)
    publisher.cleared()
    stored = [e for _, batch in receive(sub, 2) for e in batch.events if isinstance(e, BlockStored)]
    assert [(s.token_ids, s.lora_id, s.lora_name) for s in stored] == [(a, 2, "a"), (a, None, None)]
    assert stored[0].block_hashes == block_hashes(a, PAGE, "a") and stored[1].block_hashes == block_hashes(a, PAGE)
    assert not set(stored[0].block_hashes) & set(stored[1].block_hashes)
    sub.close(linger=0)
    ctx.term()
    publisher.close()


def test_host_tier_events_carry_its_medium(publisher):
    """A page the device evicts is stored on the host ("CPU") before it is removed from the device ("GPU"); a
    prefix loaded back is stored on the device again; the host tree's start clears like the device tree's."""
    ctx = zmq.Context()
    sub = subscribe(ctx, publisher.endpoint)
    device = PagedAllocator(4, PAGE)
    pool = HostPool(SimpleNamespace(buffer=torch.zeros(5, PAGE), page_size=PAGE), 8)
    cache = HiRadixCache(device, pool, "write_back", publisher)
    a = list(range(100, 112))  # 3 pages
    insert(cache, a)
    cache.evict(3)
    assert len(cache.match_prefix(a).slots) == len(a)  # from the host tier
    publisher.cleared()  # the end
    events = [e for _, batch in receive(sub, 3) for e in batch.events]
    hashes = block_hashes(a, PAGE)
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared)] == [
        ("BlockStored", "GPU", hashes),
        ("BlockStored", "CPU", hashes),
        ("BlockRemoved", "GPU", hashes),
        ("BlockStored", "GPU", hashes),
    ]
    assert [isinstance(e, AllBlocksCleared) for e in events[:2]] == [True, True]  # device tree, host tree
    cache.check_integrity()
    sub.close(linger=0)
    ctx.term()


def test_replay_serves_a_missed_range_then_end_of_sequence(publisher):
    cache = cache_with(publisher)
    for i in range(3):
        insert(cache, [i] * 8)
    deadline = time.monotonic() + 5
    while publisher.batches < 1 or not publisher.queue.empty():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))  # no subscriber was listening: replay from 0
    replayed = []
    while True:
        assert dealer.poll(5000), "no replay answer"
        _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            break
        replayed.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    assert [s for s, _ in replayed] == list(range(publisher.batches))
    events = [e for _, batch in replayed for e in batch.events]
    assert isinstance(events[0], AllBlocksCleared)  # a new cache says so first
    assert [e.token_ids for e in events if isinstance(e, BlockStored)] == [[i] * 8 for i in range(3)]
    dealer.close(linger=0)
    ctx.term()


def test_a_full_queue_drops_counts_and_clears_before_the_next_event():
    config = KVEventsConfig(endpoint="tcp://127.0.0.1:*", max_queue_size=2)
    pub = KVEventPublisher(config, PAGE, "127.0.0.1")
    pub.close()  # the thread stops reading: the queue fills
    for i in range(3):
        pub.stored([i] * PAGE, 0, "GPU")
    assert pub.dropped == 1 and pub.queue.qsize() == 2
    pub.queue.get_nowait()
    pub.queue.get_nowait()
    pub.stored([9] * PAGE, 0, "GPU")
    assert [pub.queue.get_nowait()[0] for _ in range(2)] == ["cleared", "stored"]


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="buffer_steps"):
        parse_kv_events_config('{"publisher": "zmq", "buffer_steps": 0}')
    with pytest.raises(ValueError, match="endpiont"):
        parse_kv_events_config('{"endpiont": "tcp://*:5557"}')
    assert parse_kv_events_config('{"publisher": "null"}') is None
