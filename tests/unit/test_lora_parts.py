"""LoRA's parts without a server: --lora-paths' forms, the slot pool's LRU, pins, pinned adapters and unloads, the
manager's unload under a running request, a batch's segments, and the segmented product against each row's own
x A^T B^T * scaling (rows without an adapter untouched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.core.request import Req
from common.lora.adapter import LoraAdapter, LoraEntry, parse_lora_paths
from common.lora.batch import LoraBatch, make_lora_batch, segments_of
from common.lora.manager import LoraManager, LoraShape
from common.lora.slots import LoraSlots
from common.wire.errors import InvalidRequest, NotFound
from common.wire.sampling_params import SamplingParams
from common.wire.user_error import UserError

SHAPES = {"q_proj": (6, 5), "down_proj": (5, 7)}


def adapter(name: str, rank: int, seed: int, modules=("q_proj",)) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {
        (0, m): (torch.randn(rank, SHAPES[m][1], generator=g), torch.randn(SHAPES[m][0], rank, generator=g))
        for m in modules
    }
    return LoraAdapter(name, Path(name), rank, 2.0 / rank, frozenset(modules), weights)


def slots(count: int = 2) -> LoraSlots:
    return LoraSlots(count, 4, SHAPES, 1, "cpu", torch.float32)


def test_slots_load_lru_and_never_evict_a_pinned_adapter():
    pool = slots()
    a, b, c = adapter("a", 2, 0), adapter("b", 4, 1), adapter("c", 3, 2)
    sa, sb = pool.pin(a), pool.pin(b)
    assert (sa, sb) == (0, 1) and pool.loads == 2
    assert not pool.can_pin("c") and pool.can_pin("a")  # both pinned: c waits, a is held
    assert pool.pin(a) == sa and pool.loads == 2  # held: no copy
    pool.unpin(sb)
    assert pool.can_pin("c") and pool.pin(c) == sb and pool.held == ["a", "c"]
    pool.unpin(sa)
    pool.unpin(sa)
    pool.unpin(sb)
    assert pool.pin(b) == sa and pool.held == ["b", "c"]  # the least recently used slot: a's (pinned before c)
    assert pool.loads == 4


def test_lora_paths_take_name_path_json_objects_and_json_lists():
    pinned = json.dumps({"lora_name": "p", "lora_path": "/x/p", "pinned": True, "max_rank": 16})
    listed = json.dumps([{"lora_name": "q", "lora_path": "/x/q"}])
    assert parse_lora_paths(["a=/x/a", "/x/b", pinned, listed]) == [
        LoraEntry("a", "/x/a"),
        LoraEntry("b", "/x/b"),
        LoraEntry("p", "/x/p", True, 16),
        LoraEntry("q", "/x/q"),
    ]
    with pytest.raises(UserError, match="give each JSON adapter lora_name and lora_path"):
        parse_lora_paths(['{"lora_name": "a", "path": "/x"}'])
    with pytest.raises(UserError, match="pinned must be true or false"):
        parse_lora_paths(['{"lora_name": "a", "lora_path": "/x", "pinned": "yes"}'])


def test_a_pinned_adapter_keeps_its_slot_and_an_evicted_one_frees_it():
    pool = slots()
    a, b, c = adapter("a", 2, 0), adapter("b", 4, 1), adapter("c", 3, 2)
    pool.keep(a)
    assert pool.held == ["a", None] and pool.pins == [0, 0]
    pool.unpin(pool.pin(b))
    assert pool.pin(c) == 1 and pool.held == ["a", "c"]  # b's slot reused: a's is kept though unpinned
    pool.unpin(1)
    pool.evict("c")
    pool.evict("a")
    assert pool.held == [None, None] and pool.kept == set()


def test_an_adapter_unloaded_under_a_request_leaves_when_it_ends():
    lora = LoraManager([adapter("a", 2, 0)], slots(), LoraShape(SHAPES, 1, 4))
    req = Req("r", [1, 2, 3], SamplingParams(), lora="a", lora_id=lora.ids["a"])
    assert lora.track(req) and lora.can_admit(req)
    lora.admit(req)
    assert lora.remove("a") == 1 and "a" not in lora.ids and lora.slots.held[0] == "a"
    with pytest.raises(InvalidRequest, match="unloaded, requests still run under it"):
        lora.add(adapter("a", 2, 0))
    lora.end(req)
    assert lora.adapters == {} and lora.slots.held == [None, None] and lora.slots.pins == [0, 0]
    assert not lora.track(Req("s", [1], SamplingParams(), lora="a"))  # accepted before the unload: refused
    with pytest.raises(NotFound, match="'a': no such adapter"):
        lora.remove("a")
    lora.add(adapter("a", 2, 0))
    assert lora.ids["a"] == 2  # a new prefix-cache namespace: the old pages are never the new adapter's


def test_pinning_every_slot_is_refused():
    lora = LoraManager([], slots(), LoraShape(SHAPES, 1, 4))
    lora.add(adapter("a", 2, 0), pinned=True)
    with pytest.raises(InvalidRequest, match="would leave no slot for the other adapters"):
        lora.add(adapter("b", 2, 1), pinned=True)


def test_a_slot_loaded_over_a_larger_rank_is_padded_with_zeros():
    pool = slots(1)
    pool.pin(adapter("big", 4, 0))
    pool.unpin(0)
    small = adapter("small", 2, 1)
    pool.pin(small)
    a, b = pool.a[(0, "q_proj")][0], pool.b[(0, "q_proj")][0]
    assert torch.equal(a[:2], small.weights[(0, "q_proj")][0]) and not a[2:].any() and not b[2:].any()
    assert not pool.a[(0, "down_proj")][0].any()  # a module the adapter leaves alone adds nothing


def test_segments_merge_neighbours_of_one_slot_and_skip_rows_without_one():
    assert segments_of([0, 0, None, 1, 0], [3, 1, 2, 1, 2]) == [(0, 4, 0), (6, 7, 1), (7, 9, 0)]
    assert segments_of([None, 1, 1], [1, 0, 2]) == [(1, 3, 1)]


def test_the_segmented_product_equals_each_rows_own_delta():
    pool = slots()
    ad = {"a": adapter("a", 2, 0, ("q_proj", "down_proj")), "b": adapter("b", 4, 1)}
    slot = {n: pool.pin(x) for n, x in ad.items()}
    rows = ["a", None, "b", "a"]
    lens = [3, 2, 1, 2]
    x = torch.randn(sum(lens), 5)
    base = torch.randn(sum(lens), 6)
    segments = segments_of([slot.get(r) for r in rows], lens)
    batch = LoraBatch(segments, pool)
    got = batch.layer(0).add(base.clone(), x, "q_proj")
    gathered = make_lora_batch(segments, pool, "cpu")  # a few rows over several segments: masked
    assert gathered.masked is not None
    torch.testing.assert_close(gathered.layer(0).add(base.clone(), x, "q_proj"), got)
    want, start = base.clone(), 0
    for name, n in zip(rows, lens):
        if name is not None:
            a, b = ad[name].weights[(0, "q_proj")]
            want[start : start + n] += x[start : start + n] @ a.T @ b.T * ad[name].scaling
        start += n
    torch.testing.assert_close(got, want)
    assert torch.equal(got[3:5], base[3:5])  # the base model's rows: untouched
    assert torch.equal(batch.layer(1).add(base.clone(), x, "q_proj"), base)  # a layer no slot covers
