"""The KV store tier with real servers (tiny model) sharing one Mooncake Store (a master and a memory-holding
client on 127.0.0.1, over TCP): a monolithic server A and a PD pair, both with a small device pool and a host
tier, A with --hicache-storage-prefetch-policy wait_complete, the pair with none (the default with a store:
timeout); a monolithic server without any of it gives the reference tokens.

- the PD pair's prefill serves the prefixes A computed from the store (its default policy waits for them): exact
  hit counts, the reference tokens;
- the pair's decode writes each finished turn, so the conversation's next turn, sent to A, finds the turn's
  output tokens' KV in the store;
- a restarted server serves warm from the store;
- a page whose object was corrupted in the store is never loaded (the pages before it are, the rest is
  computed), with the reference tokens;
- the master killed: every server serves on without the tier within a bounded wait (counted), and uses it
  again once it is back.

Every server passes its integrity check after every test: device pages all free or cached, host pages none
locked or prefetching (every store job collected)."""

from __future__ import annotations

import re
import time

import pytest

from common.memory.store.keys import page_key, prefix_digests
from tests.conftest import start_server
from tests.integration.cluster import generate, spawn_cluster
from tests.integration.faults import wait_until
from tests.integration.kv_store_procs import MooncakeStoreProcs
from tests.integration.tiny_model import random_prompts

PS = 16
FLAGS = ("--page-size", str(PS), "--chunked-prefill-size", "256", "--max-total-tokens", "1024")
HOST = ("--enable-hierarchical-cache", "--hicache-ratio", "4")
WAIT_COMPLETE = ("--hicache-storage-prefetch-policy", "wait_complete")
PROMPTS = random_prompts(6, 340, 340, seed=21)  # 21 whole pages each and a partial one
FULL = 336  # what a prompt of 340 can reuse: its 21 whole pages
IO_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def store():
    procs = MooncakeStoreProcs()
    yield procs
    procs.stop()


@pytest.fixture(scope="module")
def servers(tiny_model_dir, store, reference_servers):
    pytest.importorskip("mooncake.store")
    extra = store.extra_config(io_timeout_s=IO_TIMEOUT_S, retry_interval_s=0.5, prefetch_timeout_base=10.0)
    flags = ("--model", str(tiny_model_dir), *FLAGS, *HOST, "--hicache-storage-backend", "mooncake")
    flags += ("--hicache-storage-backend-extra-config", extra)
    a = c = None
    try:
        a = start_server(*flags, *WAIT_COMPLETE, name="store-a")
        c = spawn_cluster("mooncake", flags=flags)  # no prefetch policy: a server with a store waits by default
        ref = reference_servers.get("--model", str(tiny_model_dir), *FLAGS)
        yield a.wait_ready(), c.wait_ready(), ref
    finally:
        for s in (a, c):
            if s is not None:
                s.stop()


@pytest.fixture(scope="module")
def a(servers):
    return servers[0]


@pytest.fixture(scope="module")
def pd(servers):
    return servers[1]


@pytest.fixture(scope="module")
def expected(servers):
    """The reference server's greedy tokens for a prompt (computed there from scratch)."""
    return lambda prompt, n=8: generate(servers[2].url, prompt, n)["output_ids"]


@pytest.fixture(autouse=True)
def pools_whole_after(servers):
    yield
    for server in [servers[0], *servers[1].nodes]:
        tiers_idle(server)


def tiers_idle(server) -> None:
    """Every store job collected and every pool back to free or cached."""
    server.wait_idle()
    wait_until(lambda: server.info()["host_tier"]["locked"] == 0, 20, f"{server.name}'s store writes")
    host = server.info()["host_tier"]
    assert host["free"] + host["cached"] == host["total"] and host["prefetching"] == 0


def store_counts(server) -> dict:
    return server.info()["kv_store"]


def computed(url: str, node, prompt: list[int], max_new: int = 8) -> dict:
    """`prompt` computed from scratch (nothing of it cached) where `url` sends it; `node`'s pages then written."""
    out = generate(url, prompt, max_new)
    assert out["meta_info"].get("prefill_cached_tokens", out["meta_info"]["cached_tokens"]) == 0
    tiers_idle(node)
    return out


def test_a_pd_pair_serves_the_prefixes_a_monolithic_server_computed_from_the_store(a, pd, expected):
    for prompt in PROMPTS[:2]:
        assert computed(a.url, a, prompt)["output_ids"] == expected(prompt)
    assert store_counts(a)["pages_written"] == 2 * 21
    prefill = pd.nodes[0]
    summary = r"hicache_storage_prefetch_policy += timeout  \(the default with a KV store"
    assert re.search(summary, prefill.log_path.read_text(errors="replace"))  # its start-up summary says so
    for prompt in PROMPTS[:2]:
        before = store_counts(prefill)
        out = generate(pd.url, prompt, 8)
        assert out["output_ids"] == expected(prompt) and out["meta_info"]["prefill_cached_tokens"] == FULL
        after = store_counts(prefill)
        assert (after["pages_read"] - before["pages_read"], after["hit_tokens"] - before["hit_tokens"]) == (21, FULL)


def test_a_conversation_moved_to_another_server_finds_its_turns_in_the_store(a, pd, expected):
    turn = generate(pd.url, PROMPTS[2], 40, sampling={"ignore_eos": True})  # 340 + 40: the decode caches 23 pages
    decode = pd.nodes[1]
    tiers_idle(decode)
    assert store_counts(decode)["pages_written"] == 2  # the pages holding output tokens: the prefill wrote 21
    follow_up = PROMPTS[2] + turn["output_ids"] + random_prompts(1, 30, 30, seed=22)[0]
    out = generate(a.url, follow_up, 8)
    assert out["meta_info"]["cached_tokens"] == 23 * PS  # the prompt's pages and the turn's output's
    assert out["output_ids"] == expected(follow_up)


def test_a_restarted_server_serves_warm_from_the_store(a, expected):
    a.restart().wait_ready()
    out = generate(a.url, PROMPTS[1], 8)
    assert out["output_ids"] == expected(PROMPTS[1]) and out["meta_info"]["cached_tokens"] == FULL
    assert store_counts(a)["pages_read"] == 21


def test_a_corrupted_page_is_never_loaded(a, pd, store, expected):
    prompt = PROMPTS[3]
    computed(pd.url, pd.nodes[0], prompt)
    key = page_key(store_counts(a)["namespace"], prefix_digests(prompt, PS, 5, 1)[0])
    store.corrupt(key)
    before = store_counts(a)
    out = generate(a.url, prompt, 8)
    assert out["output_ids"] == expected(prompt) and out["meta_info"]["cached_tokens"] == 5 * PS
    after = store_counts(a)
    assert (after["corrupt"] - before["corrupt"], after["pages_read"] - before["pages_read"]) == (1, 5)


def test_the_master_down_serving_goes_on_without_the_tier_then_uses_it_again(a, pd, store, expected):
    store.kill_master()
    for url in (a.url, pd.url):
        started = time.monotonic()
        out = generate(url, PROMPTS[4], 8)
        assert time.monotonic() - started < IO_TIMEOUT_S + 3  # one bounded wait, then computed
        assert out["output_ids"] == expected(PROMPTS[4])
    for server in (a, *pd.nodes):
        counts = store_counts(server)
        assert not counts["available"] and counts["unavailable"] == 1
    assert store_counts(a)["skipped"] >= 1 and store_counts(pd.nodes[0])["skipped"] >= 1
    store.start_master()
    store.wait_mounted()
    for server in (a, *pd.nodes):
        wait_until(lambda s=server: store_counts(s)["available"], 30, f"{server.name} to reach the store again")
    assert computed(a.url, a, PROMPTS[5])["output_ids"] == expected(PROMPTS[5])
    out = generate(pd.url, PROMPTS[5], 8)
    assert out["output_ids"] == expected(PROMPTS[5]) and out["meta_info"]["prefill_cached_tokens"] == FULL
