"""The KV store tier without a model: a cache writes its host pages to a store (the file backend in a temporary
directory), a second cache (a cold server) prefetches them into its host tier and loads them into its device
pool byte for byte; a corrupted object is refused; an unavailable store is skipped and used again when back.
Every cache passes its integrity check after every scenario."""

from __future__ import annotations

import time

import pytest
import torch

from common.config import ServerConfig
from common.core.request import LORA_KEY_STRIDE, Req
from common.memory.allocator import PagedAllocator
from common.memory.host_pool import HostPool
from common.memory.kv_pool import KVPool
from common.memory.store.backend import FileStore, StoreUnavailable
from common.memory.store.config import FileConfig, parse_size, parse_store_config
from common.memory.store.objects import HEADER_BYTES, pack_header, verify
from common.memory.store.store_cache import StoreRadixCache
from common.memory.store.tier import StoreJob, StoreTier
from common.wire.sampling_params import SamplingParams

PS = 4


class Flaky(FileStore):
    """The file backend, unreachable while `down` is set."""

    down = False

    def exists(self, keys):
        if self.down:
            raise StoreUnavailable("down for the test")
        return super().exists(keys)


def make(
    path, policy="wait_complete", backend=None, device_pages=8, host_pages=32, adapters=None
) -> tuple[StoreRadixCache, KVPool]:
    """`adapters`: the server's LoRA adapters by lora_id (its numbering)."""
    pool = KVPool(2, device_pages, PS, 1, 2, torch.float32, "cpu")
    host = HostPool(pool, host_pages)
    config = FileConfig(file_path=str(path), prefetch_threshold=0, retry_interval_s=0.05, io_timeout_s=2)
    tier = StoreTier(backend or FileStore(str(path)), host.buffer, "ns", PS, 2.0, 0.05)
    cache = StoreRadixCache(
        PagedAllocator(device_pages, PS),
        host,
        "write_through",
        None,
        tier=tier,
        config=config,
        policy=policy,
        read=True,
        adapter_name=(adapters or {}).get,
    )
    wait_for(lambda: tier.available)
    return cache, pool


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def settle(cache: StoreRadixCache) -> None:
    """Poll until no store job is in flight (what the scheduler's steps do)."""

    def idle():
        cache.poll()
        return not cache.waiting and cache.host.locked_pages() == 0

    wait_for(idle)


def finish(cache, pool, tokens) -> None:
    slots = cache.allocator.alloc_token_slots(0, len(tokens), -1)
    at = pool.locate(slots)
    for layer in range(pool.num_layers):
        kv = torch.tensor(tokens, dtype=torch.float32)[:, None, None].expand(-1, 1, 2) + layer
        pool.set_kv(layer, at, kv, -kv)
    cache.cache_finished_req(tokens, slots, cache.device.root)


def kv_of(pool, slots):
    at = pool.locate(slots)
    return torch.stack([pool.k_at(layer, at)[:, 0, 0] - layer for layer in range(pool.num_layers)])


PROMPT = list(range(100, 124))  # 6 pages


def request(prompt: list[int]) -> Req:
    return Req("r", prompt, SamplingParams())


def test_a_cold_cache_loads_another_caches_pages_from_the_store(tmp_path):
    warm, warm_pool = make(tmp_path)
    finish(warm, warm_pool, PROMPT)
    settle(warm)
    assert warm.tier.counts["pages_written"] == 6 and len(list(tmp_path.iterdir())) == 6
    cold, cold_pool = make(tmp_path)
    req = request(PROMPT + [1])
    cold.prefetch(req, PROMPT + [1])
    assert not cold.ready(req)  # wait_complete: not before the pages came
    settle(cold)
    assert cold.ready(req) and cold.store_hit_tokens == req.store_hit_len == 24
    assert cold.tier.counts["pages_read"] == 6
    match = cold.match_prefix(PROMPT + [1])
    assert len(match.slots) == 24
    assert kv_of(cold_pool, match.slots).tolist() == [[float(t) for t in PROMPT]] * 2
    for cache in (warm, cold):
        cache.check_integrity()
        cache.close()


def keyed(tokens: list[int], lora_id: int) -> list[int]:
    """Cache keys of `tokens` under lora_id (Req.cache_key)."""
    return [t + lora_id * LORA_KEY_STRIDE for t in tokens]


def test_the_same_tokens_under_two_adapters_are_two_objects_found_by_name_on_a_server_numbering_them_otherwise(
    tmp_path,
):
    """A's and B's pages of one prompt are three objects each; a cold server that numbers A and B the other way
    round reads each adapter's own pages back (by name), and the base model none of them."""
    warm, warm_pool = make(tmp_path, host_pages=24, adapters={1: "a", 2: "b"})
    for lora_id in (1, 2):  # each page's KV is its cache keys' values: A's and B's differ
        finish(warm, warm_pool, keyed(PROMPT[:12], lora_id))
        settle(warm)
    assert warm.tier.counts["pages_written"] == 6 and len(list(tmp_path.iterdir())) == 6  # 3 pages each
    cold, cold_pool = make(tmp_path, host_pages=24, adapters={1: "b", 2: "a"})
    for lora_id, warm_id in ((1, 2), (2, 1)):
        keys = keyed(PROMPT[:13], lora_id)
        cold.prefetch(request(PROMPT[:13]), keys)
        settle(cold)
        slots = cold.match_prefix(keys).slots
        want = torch.tensor(keyed(PROMPT[:12], warm_id), dtype=torch.float32).tolist()
        assert len(slots) == 12 and kv_of(cold_pool, slots)[0].tolist() == want, f"lora_id {lora_id}'s pages"
    base = PROMPT[:12] + [1]
    cold.prefetch(request(base), base)
    settle(cold)
    assert len(cold.match_prefix(base).slots) == 0  # the base model never reads an adapter's page
    for cache in (warm, cold):
        cache.check_integrity()
        cache.close()


def test_a_corrupted_page_and_every_page_after_it_are_never_loaded(tmp_path):
    warm, warm_pool = make(tmp_path)
    finish(warm, warm_pool, PROMPT)
    settle(warm)
    cold, _ = make(tmp_path)
    third = cold.tier._keys(StoreJob("read", PROMPT, 2, [0]))[1][0]
    data = bytearray((tmp_path / third).read_bytes())
    data[HEADER_BYTES + 5] ^= 1  # one bit of the page's bytes
    (tmp_path / third).write_bytes(bytes(data))
    cold.prefetch(request(PROMPT), PROMPT)
    settle(cold)
    assert cold.tier.counts["corrupt"] == 1 and cold.store_hit_tokens == 8  # the two pages before it
    assert len(cold.match_prefix(PROMPT).slots) == 8
    cold.check_integrity()
    for cache in (warm, cold):
        cache.close()


def test_an_unavailable_store_is_skipped_and_used_again_when_back(tmp_path):
    backend = Flaky(str(tmp_path))
    cache, pool = make(tmp_path, backend=backend)
    backend.down = True
    finish(cache, pool, PROMPT)  # the write finds the store down: skipped, its host node unlocked
    settle(cache)
    assert not cache.tier.available and cache.tier.counts["unavailable"] == 1
    assert cache.tier.counts["pages_written"] == 0 and list(tmp_path.iterdir()) == []
    req = request(list(range(500, 520)))
    cache.prefetch(req, req.prompt_ids)
    assert cache.ready(req) and not cache.waiting  # nothing to wait for while it is down
    backend.down = False
    wait_for(lambda: cache.tier.available)
    cache.evict(8)
    finish(cache, pool, list(range(200, 216)))
    settle(cache)
    assert cache.tier.counts["pages_written"] == 4
    cache.check_integrity()
    cache.close()


def test_the_timeout_policy_admits_a_request_once_its_deadline_passed(tmp_path):
    cache, _ = make(tmp_path, policy="timeout")
    cache.store_config = FileConfig(
        file_path=str(tmp_path), prefetch_threshold=0, prefetch_timeout_base=0.2, prefetch_timeout_per_ki_token=0
    )
    release = []
    slow = cache.tier.backend.exists
    cache.tier.backend.exists = lambda keys: (wait_for(lambda: release, 5), slow(keys))[1]
    req = request(PROMPT)
    cache.prefetch(req, PROMPT)
    assert not cache.ready(req)
    time.sleep(0.25)
    assert cache.ready(req)
    release.append(1)
    settle(cache)
    cache.check_integrity()
    cache.close()


def test_an_object_is_refused_unless_whole_and_of_the_page_asked_for():
    page = memoryview(bytes(range(64)))
    digest = bytes(range(32))
    header = pack_header(digest, page)
    assert len(header) == HEADER_BYTES and verify(header, digest, page) is None
    assert verify(header, bytes(32), page) == "the header names another page"
    assert verify(header, digest, memoryview(bytes(64))) == "the page's CRC-32 does not match"
    assert verify(header, digest, memoryview(bytes(32))).startswith("the header gives 64 bytes")
    assert verify(header[:10], digest, page) == "the header is cut short"
    assert verify(b"XXXX" + header[4:], digest, page) == "not a version-1 Tandem page"


def test_the_extra_config_names_a_bad_field_and_the_flag():
    assert parse_size("4GB") == 4 * 2**30 and parse_size("512 mb") == 512 * 2**20 and parse_size(7) == 7
    assert (
        parse_store_config(
            "mooncake", '{"master_server_address": "h:1", "global_segment_size": "1GB"}'
        ).global_segment_size
        == 2**30
    )
    with pytest.raises(ValueError, match="extra-config: master_server_address: Field required"):
        parse_store_config("mooncake", "{}")
    with pytest.raises(ValueError, match="extra-config: master_server_address: Extra inputs"):
        parse_store_config("file", '{"master_server_address": "h:1"}')
    with pytest.raises(ValueError, match="needs --enable-hierarchical-cache|add --enable-hierarchical-cache"):
        ServerConfig(hicache_storage_backend="file")
    with pytest.raises(ValueError, match="not JSON"):
        ServerConfig(
            enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_backend_extra_config="{"
        )


def test_a_server_with_a_store_waits_for_its_prefixes_by_default_and_a_given_policy_wins(monkeypatch):
    store = {"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}
    assert ServerConfig().hicache_storage_prefetch_policy == "best_effort"  # no store: SGLang's default
    config = ServerConfig(**store)
    assert config.hicache_storage_prefetch_policy == "timeout"
    [line] = [line for line in config.summary().splitlines() if "prefetch_policy" in line]
    assert line.split("=", 1)[1].strip().startswith("timeout  (the default with a KV store")
    assert ServerConfig(**store, hicache_storage_prefetch_policy="best_effort").hicache_storage_prefetch_policy == (
        "best_effort"
    )
    monkeypatch.setenv("TANDEM_HICACHE_STORAGE_PREFETCH_POLICY", "wait_complete")
    assert ServerConfig(**store).hicache_storage_prefetch_policy == "wait_complete"


class Events:
    """A CacheListener that keeps what it hears."""

    def __init__(self):
        self.heard = []

    def stored(self, tokens, start, medium):
        self.heard.append(("stored", len(tokens), start, medium))

    def removed(self, tokens, start, medium):
        self.heard.append(("removed", len(tokens), start, medium))

    def cleared(self):
        pass


def test_pages_written_to_the_store_are_published_with_their_tier(tmp_path):
    cache, pool = make(tmp_path)
    cache.host.listener = cache.device.listener = events = Events()
    finish(cache, pool, PROMPT)
    settle(cache)
    assert events.heard == [("stored", 24, 0, "GPU"), ("stored", 24, 0, "CPU"), ("stored", 24, 0, "STORE")]
    cache.close()


def test_a_store_call_past_its_bound_marks_the_store_unavailable_and_frees_the_waiting_request(tmp_path):
    cache, _ = make(tmp_path, policy="wait_complete")
    cache.tier.io_timeout_s = 0.2
    release = []
    slow = cache.tier.backend.exists
    cache.tier.backend.exists = lambda keys: (wait_for(lambda: release, 5), slow(keys))[1]
    req = request(PROMPT)
    cache.prefetch(req, PROMPT)
    cache.poll()
    assert not cache.ready(req)
    time.sleep(0.3)
    cache.poll()  # sees the call past its bound
    assert cache.ready(req) and not cache.tier.available and cache.tier.counts["unavailable"] == 1
    release.append(1)
    settle(cache)  # the call returns: its pages are taken back; the probe finds the store again
    wait_for(lambda: cache.tier.available)
    cache.check_integrity()
    cache.close()
