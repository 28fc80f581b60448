"""Pools, the page allocator and the radix cache, without a model."""

from __future__ import annotations

import random

import pytest
import torch

from common.memory.allocator import PagedAllocator
from common.memory.errors import MemoryIntegrityError
from common.memory.kv_pool import BufferInfo, KVPool
from common.memory.radix_cache import RadixCache
from common.memory.req_to_token_pool import ReqToTokenPool


def slots_for(alloc: PagedAllocator, n: int) -> torch.Tensor:
    return alloc.alloc_token_slots(0, n, -1)


# -- allocator ---------------------------------------------------------------------------------
def test_allocator_hands_out_lowest_pages_and_reuses_freed_ones_in_order():
    a = PagedAllocator(8, 4)
    assert a.alloc(3) == [1, 2, 3]
    assert a.alloc(2) == [4, 5]
    a.free([2, 1])
    a.free([3])
    assert a.alloc(4) == [1, 2, 3, 6]  # freed pages merged and sorted: a contiguous run again
    a.check_integrity()


def test_allocator_rejects_double_free_and_page_zero():
    a = PagedAllocator(4, 2)
    pages = a.alloc(2)
    a.free(pages)
    with pytest.raises(ValueError, match="already free"):
        a.free([pages[0]])
    with pytest.raises(ValueError, match="out of range"):
        a.free([0])


@pytest.mark.parametrize("page_size", [1, 16])
def test_token_slots_fill_the_partial_page_before_taking_new_pages(page_size):
    a = PagedAllocator(10, page_size)
    first = a.alloc_token_slots(0, page_size + 1, -1)
    assert first.tolist() == list(range(page_size, 2 * page_size + 1))
    more = a.alloc_token_slots(page_size + 1, 2 * page_size + 2, int(first[-1]))
    expect_head = list(range(2 * page_size + 1, 3 * page_size))
    assert more.tolist()[: len(expect_head)] == expect_head
    assert len(more) == page_size + 1
    used = {1: 4, 16: 3}[page_size]  # ps=1: a page per token; ps=16: 17 + 17 tokens fill 3 pages
    assert a.available_pages() == 10 - used


def test_allocator_raises_when_exhausted():
    a = PagedAllocator(2, 4)
    assert not a.can_alloc(3)
    with pytest.raises(RuntimeError):
        a.alloc_token_slots(0, 9, -1)


# -- pools -------------------------------------------------------------------------------------
def test_kv_pool_is_page_major_and_one_buffer():
    pool = KVPool(num_layers=3, num_pages=5, page_size=4, kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu")
    page_bytes = 2 * 3 * 2 * 4 * 8 * 4  # heads x layers x (K, V) x page_size x dim x fp32
    assert pool.bytes_per_page == page_bytes and pool.total_bytes == 6 * page_bytes
    assert pool.buffer_infos() == [BufferInfo(pool.buffer.data_ptr(), 6 * page_bytes, page_bytes)]
    assert pool.k_pages(1).shape == (6, 2, 4, 8)  # HND
    loc = torch.tensor([4, 9])  # page 1 offset 0, page 2 offset 1
    k = torch.randn(2, 2, 8)
    at = pool.locate(loc)
    assert at.page.tolist() == [1, 2] and at.offset.tolist() == [0, 1]
    pool.set_kv(1, at, k, -k)
    assert torch.equal(pool.k_at(1, at), k) and torch.equal(pool.v_at(1, at), -k)
    assert torch.equal(pool.k_pages(1)[2, :, 1], k[1]) and pool.k_pages(0).abs().sum() == 0
    # every byte of page 2 lies in [2 * page_bytes, 3 * page_bytes) of the buffer: one transfer piece
    flat = pool.buffer.view(-1)
    per_page = page_bytes // 4
    page = flat[2 * per_page : 3 * per_page].view(2, 3, 2, 4, 8)  # heads first: a head group is one range
    assert torch.equal(page[:, 1, 0, 1], k[1]) and torch.equal(page[:, 1, 1, 1], -k[1])
    assert flat[:per_page].abs().sum() == 0 and flat[3 * per_page :].abs().sum() == 0


def test_req_to_token_pool_alloc_free_and_exhaustion():
    p = ReqToTokenPool(2, 16, "cpu")
    a, b = p.alloc(), p.alloc()
    assert {a, b} == {0, 1} and not p.can_alloc()
    with pytest.raises(RuntimeError):
        p.alloc()
    p.free(a)
    with pytest.raises(ValueError):
        p.free(a)
    assert p.available_size() == 1
    p.check_integrity()


# -- radix cache -------------------------------------------------------------------------------
def tree(pages: int = 32, page_size: int = 2) -> tuple[PagedAllocator, RadixCache]:
    a = PagedAllocator(pages, page_size)
    return a, RadixCache(a, page_size)


def test_match_on_empty_tree_is_empty():
    _, c = tree()
    m = c.match_prefix([1, 2, 3, 4])
    assert m.slots.numel() == 0 and m.last_node is c.root


def test_insert_then_match_returns_exact_slots_page_aligned():
    a, c = tree()
    s = slots_for(a, 5)
    c.cache_finished_req([1, 2, 3, 4, 5], s, c.root)  # 4 tokens cached, the tail page freed
    m = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.slots.tolist() == s[:4].tolist()
    assert c.evictable_pages() == 2 and a.available_pages() == 30
    c.check_integrity()


def test_partial_match_splits_a_node_at_a_page_boundary():
    a, c = tree()
    s = slots_for(a, 6)
    c.insert([1, 2, 3, 4, 5, 6], s)
    m = c.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.slots.tolist() == s[:4].tolist()
    assert len(m.last_node.key) == 4 and len(next(iter(m.last_node.children.values())).key) == 2
    c.check_integrity()


def test_insert_reports_the_already_cached_length():
    a, c = tree()
    c.insert([1, 2, 3, 4], slots_for(a, 4))
    assert c.insert([1, 2, 3, 4, 7, 8], slots_for(a, 6)) == 4


def test_duplicate_pages_are_freed_when_a_finished_request_repeats_a_cached_prefix():
    a, c = tree()
    c.cache_finished_req([1, 2, 3, 4], slots_for(a, 4), c.root)
    free_before = a.available_pages()
    c.cache_finished_req([1, 2, 3, 4, 5, 6], slots_for(a, 6), c.root)
    assert a.available_pages() == free_before - 1  # only the new page (5, 6) is kept
    c.check_integrity()


def test_locked_nodes_survive_eviction_and_lru_goes_first():
    a, c = tree()
    c.insert([1, 2], slots_for(a, 2))
    c.insert([3, 4], slots_for(a, 2))
    c.insert([5, 6], slots_for(a, 2))
    c.match_prefix([1, 2])  # touch: now the most recent
    locked = c.match_prefix([5, 6]).last_node
    c.inc_lock_ref(locked)
    assert c.locked_pages() == 1 and c.evictable_pages() == 2
    assert c.evict(1) == 1
    assert c.match_prefix([3, 4]).slots.numel() == 0  # least recently used went first
    assert c.match_prefix([1, 2]).slots.numel() == 2
    assert c.evict(10) == 1 and c.match_prefix([5, 6]).slots.numel() == 2
    c.dec_lock_ref(locked)
    assert c.evict(10) == 1 and a.available_pages() == 32
    c.check_integrity()


def test_integrity_check_catches_a_page_that_is_cached_and_free():
    a, c = tree()
    s = slots_for(a, 2)
    c.insert([1, 2], s)
    a.free_slots(s)
    with pytest.raises(MemoryIntegrityError):
        c.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_workload_keeps_every_page_accounted_for(page_size):
    rng = random.Random(1234)
    a, c = tree(pages=64, page_size=page_size)
    live: list[tuple[list[int], torch.Tensor, object, int]] = []  # tokens, slots, node, own pages
    for _ in range(400):
        if live and rng.random() < 0.45:
            tokens, slots, node, _ = live.pop(rng.randrange(len(live)))
            c.cache_finished_req(tokens, slots, node)
        else:
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
            m = c.match_prefix(tokens)
            c.inc_lock_ref(m.last_node)
            need = a.pages_needed(len(m.slots), len(tokens))
            if need > a.available_pages():
                c.evict(need - a.available_pages())
            if need > a.available_pages():
                c.dec_lock_ref(m.last_node)
                continue
            last = int(m.slots[-1]) if len(m.slots) else -1
            own = a.alloc_token_slots(len(m.slots), len(tokens), last)
            live.append((tokens, torch.cat([m.slots, own]), m.last_node, need))
        c.check_integrity()
        a.check_integrity()
        owned = sum(p for *_, p in live)
        assert a.available_pages() + c.evictable_pages() + c.locked_pages() + owned == 64
