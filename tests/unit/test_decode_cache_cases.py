"""The decode's prefix cache on the simulated PD pair (test_kv_handoff_model.py): a conversation's next
turn matches the last turn's prompt and answer at the decode, which reserves pages for the rest only;
the prefill sends exactly those pages; a room that fails mid-suffix caches nothing it did not receive and
unlocks its prefix; eviction under pressure spares a room's locked prefix. Each ends with the model's teardown (every half ended, every pool back to idle)."""

from __future__ import annotations

from tests.unit.kv_handoff_sim import CONFIG
from tests.unit.test_kv_handoff_model import KVHandoff, Pair, monolithic_answer
from transfer.decode.receiver import KVReceiver

PS = CONFIG.page_size


def answered(m: KVHandoff, pair: Pair, rounds: int = 40) -> None:
    for _ in range(rounds):
        if pair.decode.finished and pair.prefill.finished:
            break
        m._one_round()
    assert pair.decode.finish.type == "length", pair.decode.finish


def next_turn(m: KVHandoff, prev: Pair, new: list[int], max_new: int) -> Pair:
    history = prev.decode.prompt_ids + monolithic_answer(prev.decode.prompt_ids, prev.decode.params.max_new_tokens)
    m._submit(history + new, max_new)
    return m.pairs[-1]


def test_a_next_turn_sends_only_the_pages_the_decode_lacks():
    """Turn 1: 10 prompt tokens, 6 answered; the decode caches the 15 with KV as 3 pages (12 tokens), the
    prefill its prompt's 2 pages. Turn 2 (21 tokens = 10 + 6 + 5 new): the decode matches 12, reserves
    pages for tokens 12..20 only (3 pages) and the prefill, which computes from its own 8, sends exactly
    those 3 pages; the tokens equal a monolithic server's and both hits are reported."""
    m = KVHandoff()
    m._submit(list(range(1, 11)), 6)
    first = m.pairs[0]
    answered(m, first)
    page_bytes = m.prefill.manager.writer.page_bytes
    sent_before = m.prefill.manager.counters["bytes_sent"]
    assert sent_before == 3 * page_bytes  # turn 1: the whole 10-token prompt
    second = next_turn(m, first, [401, 402, 403, 404, 405], 3)
    answered(m, second)
    assert second.decode.output_ids == monolithic_answer(second.decode.prompt_ids, 3) == [406, 407, 408]
    assert (second.decode.decode_hit_len, second.decode.prefix_hit_len, second.prefill.prefix_hit_len) == (12, 8, 8)
    assert m.prefill.manager.counters["bytes_sent"] - sent_before == 3 * page_bytes
    m.teardown()


def test_a_room_that_fails_mid_suffix_caches_nothing_it_did_not_receive():
    """Turn 2's room fails after the decode reserved its suffix and locked its 3 cached pages: the lock is
    released, the suffix pages (no KV arrived) are freed, not cached, and the decode's cache holds exactly
    what it held before; a third turn still hits it."""
    m = KVHandoff()
    m._submit(list(range(1, 11)), 6)
    first = m.pairs[0]
    answered(m, first)
    cache = m.decode.memory.prefix_cache
    before = (cache.evictable_pages(), sorted(tuple(n.key) for n in cache._nodes()))
    second = next_turn(m, first, [401, 402, 403, 404, 405], 3)
    for _ in range(3):  # the decode reserves; nothing is delivered, so no KV moves
        m.decode.sched.step()
    assert second.decode.decode_hit_len == 12 and cache.locked_pages() == 3
    m.decode.sched.abort(second.decode, "client went away")
    m.teardown()
    assert second.decode.finish.type == "abort" and cache.locked_pages() == 0
    assert (cache.evictable_pages(), sorted(tuple(n.key) for n in cache._nodes())) == before
    third = next_turn(m, first, [501, 502], 2)
    answered(m, third)
    assert third.decode.decode_hit_len == 12 and third.decode.output_ids == [503, 504]
    m.teardown()


def test_with_the_radix_cache_disabled_the_decode_reserves_and_receives_the_whole_prompt():
    m = KVHandoff(decode_cache=False)
    m._submit(list(range(1, 11)), 6)
    first = m.pairs[0]
    answered(m, first)
    sent_before = m.prefill.manager.counters["bytes_sent"]
    second = next_turn(m, first, [401, 402, 403, 404, 405], 3)
    answered(m, second)
    assert second.decode.decode_hit_len == 0 and second.decode.output_ids == [406, 407, 408]
    assert m.prefill.manager.counters["bytes_sent"] - sent_before == 6 * m.prefill.manager.writer.page_bytes
    m.teardown()


def test_a_prefill_refuses_a_cached_prefix_that_is_not_page_aligned(monkeypatch):
    """A decode that names a cached prefix off a page boundary gets its room failed, naming the field."""
    real_init = KVReceiver.init
    monkeypatch.setattr(
        KVReceiver,
        "init",
        lambda self, pages, slot, cached=0, dp_rank=0, lora="": real_init(self, pages, slot, cached + 1, dp_rank, lora),
    )
    m = KVHandoff()
    m._submit(list(range(1, 11)), 2)
    pair = m.pairs[0]
    for _ in range(30):
        if pair.prefill.finished and pair.decode.finished:
            break
        m._one_round()
    assert pair.prefill.finish.type == "abort"
    assert (
        "cached_prefix_len 1 must be a multiple of the page size 4 below the prompt's 10 tokens"
        in pair.prefill.finish.message
    )
    assert pair.decode.finish.type == "abort"
    m.teardown()


def test_eviction_under_pressure_spares_a_rooms_locked_prefix_and_its_target_pages():
    """The decode's cache is full of finished requests when turn 2 locks its 3 cached pages and reserves
    its suffix; new requests then need more pages than are free, so the decode evicts, but only unlocked
    pages: turn 2's prefix stays in the tree, its KV lands and its tokens are exact."""
    m = KVHandoff()
    m._submit(list(range(1, 11)), 6)
    first = m.pairs[0]
    answered(m, first)
    for k in range(3):  # 8 cached pages each (35 tokens with KV)
        m._submit([100 * (k + 1) + i for i in range(30)], 6)
        answered(m, m.pairs[-1])
    cache = m.decode.memory.prefix_cache
    second = next_turn(m, first, [401, 402, 403, 404, 405], 3)
    for _ in range(3):  # the decode reserves turn 2; no frame is delivered yet, so no KV moves
        m.decode.sched.step()
    assert second.decode.decode_hit_len == 12 and cache.locked_pages() == 3
    prefix = first.decode.prompt_ids + first.decode.output_ids[:2]  # the 12 tokens turn 2 matched
    evictable = cache.evictable_pages()
    for k in range(3):
        m._submit([50 + 100 * (k + 1) + i for i in range(30)], 2)
    for _ in range(3):
        m.decode.sched.step()
    assert cache.evictable_pages() < evictable  # the new requests made the decode evict
    assert len(cache.match_prefix(prefix).slots) == 12 and cache.locked_pages() >= 3
    answered(m, second)
    assert second.decode.output_ids == [406, 407, 408]
    m.teardown()
