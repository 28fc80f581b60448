"""The router's KV index and its feeds: the index against a plain model (Hypothesis), a feed built from a real
publisher's batches (gaps filled from its replay socket, a restart forgetting the worker's pages), and the
kv_aware cost picking the pair."""

from __future__ import annotations

import asyncio
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.kv_event_publisher import KVEventPublisher
from common.memory.allocator import PagedAllocator
from common.memory.radix_cache import RadixCache
from common.wire.kv_events import KVEventsConfig, block_hashes
from router.pair_call import Pair
from router.placement.kv_feeds import WorkerFeed
from router.placement.kv_index import KVIndex
from router.placement.kv_policy import KVAwarePolicy
from router.placement.placer import pair_policy
from router.workers import Worker, WorkerRegistry

PAGE = 4
WORKERS = ["http://a", "http://b", "http://c"]

ops = st.lists(
    st.tuples(
        st.sampled_from(["stored", "removed", "clear"]),
        st.sampled_from(WORKERS),
        st.lists(st.integers(0, 20), max_size=6),
        st.sampled_from(["GPU", "CPU"]),
    ),
    max_size=60,
)


@settings(deadline=None)
@given(ops, st.lists(st.integers(0, 20), max_size=8))
def test_index_agrees_with_a_set_per_worker_and_tier(operations, prompt):
    """A worker holds a page while any tier (medium) holds it."""
    index, tiers = KVIndex(), {w: set() for w in WORKERS}  # worker -> {(hash, medium)}
    for op, worker, hashes, medium in operations:
        if op == "stored":
            index.stored(worker, hashes, medium)
            tiers[worker] |= {(h, medium) for h in hashes}
        elif op == "removed":
            index.removed(worker, hashes, medium)
            tiers[worker] -= {(h, medium) for h in hashes}
        else:
            index.clear(worker)
            tiers[worker] = set()
    model = {w: {h for h, _ in held} for w, held in tiers.items()}
    for w in WORKERS:
        assert index.pages(w) == len(model[w])
        leading = next((i for i, h in enumerate(prompt) if h not in model[w]), len(prompt))
        assert index.matched(w, prompt) == leading
    assert index.holders == {h: {w for w in WORKERS if h in model[w]} for h in set().union(*model.values())}


def published(pub: KVEventPublisher, n: int) -> list[tuple[int, bytes]]:
    deadline = time.monotonic() + 5
    while len(pub.buffer) < n or not pub.queue.empty():
        assert time.monotonic() < deadline, f"{len(pub.buffer)} of {n} batches published"
        time.sleep(0.01)
    return list(pub.buffer)


def feed_for(pub: KVEventPublisher, index: KVIndex) -> WorkerFeed:
    import zmq.asyncio

    return WorkerFeed(zmq.asyncio.Context.instance(), index, "http://w", pub.info())


def test_feed_fills_a_gap_from_replay_and_forgets_on_restart():
    config = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    pub = KVEventPublisher(config, PAGE, "127.0.0.1")
    try:
        cache = RadixCache(PagedAllocator(64, PAGE), PAGE, pub)
        published(pub, 1)
        prompts = [[i] * 8 for i in range(4)]
        for i, p in enumerate(prompts):
            cache.cache_finished_req(p, cache.allocator.alloc_token_slots(0, 8, -1), None)
            published(pub, i + 2)  # one batch each, after the new cache's AllBlocksCleared
        batches = published(pub, 5)
        index = KVIndex()
        feed = feed_for(pub, index)

        async def run() -> None:
            await feed.on_batch(*batches[0])
            await feed.on_batch(*batches[4])  # 1..3 missed: replayed before 4 is applied
            assert feed.resyncs == 0 and feed.next_seq == 5
            assert all(index.matched("http://w", block_hashes(p, PAGE)) == 2 for p in prompts)
            await feed.on_batch(*batches[1])  # the sequence went back: a restarted worker, trusted no more
            assert feed.resyncs == 1

        asyncio.run(run())
        assert [index.matched("http://w", block_hashes(p, PAGE)) for p in prompts] == [2, 0, 0, 0]
    finally:
        pub.close()


def test_feed_without_replay_forgets_the_worker_after_a_gap():
    pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*"), PAGE, "127.0.0.1")
    try:
        cache = RadixCache(PagedAllocator(64, PAGE), PAGE, pub)
        published(pub, 1)
        for i in range(2):
            cache.cache_finished_req([i] * 4, cache.allocator.alloc_token_slots(0, 4, -1), None)
            published(pub, i + 2)
        batches, index = published(pub, 3), KVIndex()
        feed = feed_for(pub, index)

        async def run() -> None:
            for seq, payload in (batches[0], batches[1], batches[2]):
                await feed.on_batch(seq, payload)
            assert index.pages("http://w") == 2
            await feed.on_batch(5, batches[2][1])  # 3 and 4 never came, and there is no replay socket
            assert feed.resyncs == 1 and index.pages("http://w") == 1  # only what batch 5 said

        asyncio.run(run())
    finally:
        pub.close()


class FakeFeeds:
    model_path = None
    workers = WorkerRegistry(1)  # the workers whose /v1/models name the base model (none here: no adapter is known)

    def block_size(self) -> int:
        return PAGE


def test_kv_aware_cost_weighs_compute_crossing_and_load():
    index, prompt = KVIndex(), list(range(16))  # 4 pages
    hashes = block_hashes(prompt, PAGE)
    index.stored("http://p1", hashes[:3])
    index.stored("http://d0", hashes)
    p0, p1, d0, d1 = (
        Worker("http://p0", "prefill"),
        Worker("http://p1", "prefill"),
        Worker("http://d0", "decode"),
        Worker("http://d1", "decode"),
    )
    policy = pair_policy("kv_aware", None, KVAwarePolicy(index, FakeFeeds(), load_tokens=4))
    assert policy.pick_pair([p0, p1], [d0, d1], {"input_ids": prompt}) == Pair(p1, d0)
    p1.in_flight, d0.in_flight = (
        4,
        3,
    )  # p1: 4 to compute + 16 of load > 16 to compute on p0; d0: 12 of load < 16 to cross
    assert policy.pick_pair([p0, p1], [d0, d1], {"input_ids": prompt}) == Pair(p0, d0)
    d0.in_flight = 5
    assert policy.pick_pair([p0, p1], [d0, d1], {"prompt": prompt}) == Pair(p0, d1)
    assert policy.pick_pair([p0, p1], [d0, d1], {"messages": []}) == Pair(p0, d1)  # no ids: load alone


def test_kv_aware_picks_one_side_under_another_policy():
    """--policy round_robin --decode-policy kv_aware: prefills in turn, the decode that holds the prompt."""
    index, prompt = KVIndex(), list(range(16))
    index.stored("http://d1", block_hashes(prompt, PAGE))
    p0, p1 = Worker("http://p0", "prefill"), Worker("http://p1", "prefill")
    d0, d1 = Worker("http://d0", "decode"), Worker("http://d1", "decode")
    policy = pair_policy("round_robin", "kv_aware", KVAwarePolicy(index, FakeFeeds(), load_tokens=4))
    picks = [policy.pick_pair([p0, p1], [d0, d1], {"input_ids": prompt}) for _ in range(2)]
    assert picks == [Pair(p0, d1), Pair(p1, d1)]
    policy = pair_policy("kv_aware", "round_robin", KVAwarePolicy(index, FakeFeeds(), load_tokens=4))
    index.stored("http://p1", block_hashes(prompt, PAGE)[:1])
    picks = [policy.pick_pair([p0, p1], [d0, d1], {"input_ids": prompt}) for _ in range(2)]
    assert picks == [Pair(p1, d0), Pair(p1, d1)]


def test_store_pages_count_for_every_store_user_at_their_weight():
    """A page only the shared store holds is worth --kv-store-hit-weight to a prefill that uses the store (it
    reported store pages), nothing to one that does not; its host pages are worth --kv-host-hit-weight; a
    worker's clear leaves the store alone; the store's set is bounded, oldest out first."""
    index, prompt = KVIndex(store_pages=6), list(range(16))  # 4 pages
    hashes = block_hashes(prompt, PAGE)
    index.stored("http://p1", hashes, "STORE")  # p1 wrote them; p0 never used the store
    index.stored("http://p2", [], "STORE")  # p2 uses the store too
    index.stored("http://p2", hashes[:1], "GPU")
    index.stored("http://p2", hashes[1:2], "CPU")
    weights = {"GPU": 1.0, "CPU": 0.75}
    assert index.credit("http://p0", hashes, weights, 0.5) == 0
    assert index.credit("http://p1", hashes, weights, 0.5) == 4 * 0.5
    assert index.credit("http://p2", hashes, weights, 0.5) == 1 + 0.75 + 2 * 0.5
    assert index.credit("http://p2", hashes, weights, 0.0) == 1.75  # a decode: the store counts for nothing
    index.clear("http://p1")
    assert index.credit("http://p1", hashes, weights, 0.5) == 2.0 and index.pages("http://p1") == 0
    index.stored("http://p1", block_hashes(list(range(100, 112)), PAGE), "STORE")  # 3 more: 7 > 6
    assert index.credit("http://p1", hashes, weights, 0.5) == 0  # the prompt's first page was the oldest
    index.removed("http://p2", hashes[1:], "STORE")
    assert len(index.store) == 3  # the three new pages


def test_kv_aware_sends_a_prompt_to_the_prefill_that_can_read_it_from_the_store():
    index, prompt = KVIndex(), list(range(16))
    index.stored("http://p1", block_hashes(prompt, PAGE), "STORE")
    p0, p1, d0 = Worker("http://p0", "prefill"), Worker("http://p1", "prefill"), Worker("http://d0", "decode")
    policy = pair_policy("kv_aware", None, KVAwarePolicy(index, FakeFeeds(), load_tokens=4, store_weight=0.5))
    assert policy.pick_pair([p0, p1], [d0], {"input_ids": prompt}) == Pair(p1, d0)  # 8 to compute < 16
    p1.in_flight = 3  # 8 + 12 of load > 16
    assert policy.pick_pair([p0, p1], [d0], {"input_ids": prompt}) == Pair(p0, d0)
