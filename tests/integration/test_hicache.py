"""The host tier with a real server (tiny model): one monolithic server whose device pool holds 32
pages of 16 tokens and whose host tier holds 8x that (write-back).

- shared prefixes that need twice the device pool come back from the host tier: exact hit counts, the
  same greedy tokens as when they were computed;
- the overload drill: requests whose final lengths need three times the device pool, all at once, all
  complete with the tokens each gives alone; the decode retracts, and the retracted KV comes back from
  the host tier instead of being recomputed;
- priorities (--enable-priority-scheduling): a high-priority request sent behind a queue of low ones
  finishes before those still waiting;
- PD (one prefill and one decode over Mooncake, both with the same small pool and host tier): the shared
  prefixes come back from both sides' host tiers (the prefill computes nothing of them, the decode
  receives only the last page) with the monolithic server's greedy tokens.

Both tiers of every server pass their integrity check (/get_server_info runs it) after every test."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from tests.conftest import start_server
from tests.integration.cluster import generate, spawn_cluster
from tests.integration.faults import wait_until
from tests.integration.tiny_model import random_prompts

FLAGS = ("--page-size", "16", "--chunked-prefill-size", "256", "--max-total-tokens", "512")
HOST = ("--enable-hierarchical-cache", "--hicache-ratio", "8", "--hicache-write-policy", "write_back")
PRIORITY = ("--enable-priority-scheduling",)
PREFIXES = random_prompts(4, 240, 240, seed=11)  # 15 pages each; a request with its suffix holds 17
SUFFIX = random_prompts(1, 20, 20, seed=12)[0]
DRILL = random_prompts(6, 200, 200, seed=13)  # 200 + 80 new tokens: 18 pages each, 108 in all


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    """The monolithic server and the PD cluster (test_pd_shared_prefixes_...), started at once."""
    pytest.importorskip("mooncake.engine")
    s = start_server("--model", str(tiny_model_dir), *FLAGS, *HOST, *PRIORITY, name="hicache")
    c = None
    try:
        c = spawn_cluster("mooncake", flags=("--model", str(tiny_model_dir), *FLAGS, *HOST))
        yield s.wait_ready(), c.wait_ready()
    finally:
        s.stop()
        if c is not None:
            c.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def pd(servers):
    return servers[1]


@pytest.fixture(autouse=True)
def idle_after(server):
    yield
    host_tier_idle(server)


def host_tier_idle(server) -> None:
    server.wait_idle()
    host = server.info()["host_tier"]
    assert host["free"] + host["cached"] == host["total"] and host["locked"] == 0


def host_hits(server) -> int:
    return server.info()["host_tier"]["hit_tokens"]


def test_shared_prefixes_larger_than_the_device_pool_hit_in_the_host_tier(server):
    first = [generate(server.url, p + SUFFIX, 8) for p in PREFIXES]
    assert [r["meta_info"]["cached_tokens"] for r in first] == [0] * 4
    written = server.info()["host_tier"]["written"]
    assert written >= 2 * 16  # the first two prefixes left the device for the host
    for i, p in enumerate(PREFIXES):
        before = host_hits(server)
        again = generate(server.url, p + SUFFIX, 8)
        assert again["output_ids"] == first[i]["output_ids"]
        assert again["meta_info"]["cached_tokens"] == 256  # 15 prefix pages and the suffix's first
        if i < 2:  # evicted from the device by the later prefixes: every page from the host
            assert host_hits(server) - before == 256


def test_overload_drill_retracts_and_resumes_from_the_host_tier(server):
    alone = [generate(server.url, p, 80, sampling={"ignore_eos": True})["output_ids"] for p in DRILL]
    info = server.info()
    retractions, loaded = info["num_retractions"], info["host_tier"]["loaded"]
    with concurrent.futures.ThreadPoolExecutor(len(DRILL)) as pool:
        results = list(pool.map(lambda p: generate(server.url, p, 80, sampling={"ignore_eos": True}), DRILL))
    assert [r["output_ids"] for r in results] == alone
    info = server.info()
    assert info["num_retractions"] > retractions
    assert info["host_tier"]["loaded"] > loaded


def test_a_high_priority_request_overtakes_the_waiting_queue(server):
    done: dict[str, float] = {}

    def run(name: str, ids: list[int], priority: int) -> dict:
        out = generate(server.url, ids, 80, sampling={"ignore_eos": True}, priority=priority)
        done[name] = time.monotonic()
        return out

    with concurrent.futures.ThreadPoolExecutor(len(DRILL) + 1) as pool:
        lows = [pool.submit(run, f"low{i}", p, 0) for i, p in enumerate(DRILL)]
        wait_until(lambda: server.info()["num_waiting_reqs"] >= 3, 60, "low-priority requests to queue")
        high = pool.submit(run, "high", PREFIXES[0], 10)
        high.result()
        [f.result() for f in lows]
    later = [name for name, t in done.items() if t > done["high"]]
    assert len(later) >= 3, sorted(done, key=done.get)


def test_pd_shared_prefixes_hit_both_sides_host_tiers(server, pd):
    expected = [generate(server.url, p + SUFFIX, 8)["output_ids"] for p in PREFIXES]
    first = [generate(pd.url, p + SUFFIX, 8) for p in PREFIXES]
    assert [r["output_ids"] for r in first] == expected
    for i, p in enumerate(PREFIXES):
        before = [host_hits(node) for node in pd.nodes]
        again = generate(pd.url, p + SUFFIX, 8)
        assert again["output_ids"] == expected[i]
        meta = again["meta_info"]
        assert (meta["prefill_cached_tokens"], meta["decode_cached_tokens"]) == (256, 256)
        if i < 2:  # evicted from both devices by the later prefixes: every page from the host tiers
            assert [host_hits(node) - b for node, b in zip(pd.nodes, before)] == [256, 256]
    for node in pd.nodes:
        host_tier_idle(node)
