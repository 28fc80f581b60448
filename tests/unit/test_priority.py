"""Priorities without a model: the prefill queue admits higher priorities first (FIFO among equals, a
retracted request ahead of its equals), and the decode retracts the lowest priority, then the least
progress, then the newest."""

from __future__ import annotations

from types import SimpleNamespace

from common.config import ServerConfig
from common.core.request import Req, queue_position
from common.engine.decode_batch import DecodeBatch
from common.engine.prefill_queue import PrefillQueue
from common.memory.prefix_cache import NoPrefixCache
from common.wire.sampling_params import SamplingParams


def req(rid: str, priority: int = 0, progress: int = 0) -> Req:
    r = Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=8), priority=priority)
    r.output_ids = [7] * progress
    return r


NO_CACHE = SimpleNamespace(prefix_cache=NoPrefixCache(None, 16))  # queue order needs no memory


def test_the_queue_orders_by_priority_then_arrival():
    q = PrefillQueue(ServerConfig(), memory=NO_CACHE)
    for r in [req("a"), req("b", 5), req("c"), req("d", 5), req("e", -1), req("f", 9)]:
        q.add(r)
    assert [r.rid for r in q.waiting] == ["f", "b", "d", "a", "c", "e"]
    q.add_front(req("retracted", 5))
    assert [r.rid for r in q.waiting] == ["f", "retracted", "b", "d", "a", "c", "e"]


def test_without_priorities_the_queue_is_fifo_and_a_retracted_request_goes_first():
    q = PrefillQueue(ServerConfig(), memory=NO_CACHE)
    for rid in "abc":
        q.add(req(rid))
    q.add_front(req("r"))
    assert [r.rid for r in q.waiting] == ["r", "a", "b", "c"]


def test_the_victim_is_the_lowest_priority_then_the_least_progress_then_the_newest():
    config = ServerConfig()
    batch = DecodeBatch(config, memory=None)
    batch.running = [req("old-low", 0, 3), req("high", 2, 1), req("new-low", 0, 3), req("busy-low", 0, 9)]
    assert batch.victim().rid == "new-low"
    batch.running.remove(batch.victim())
    assert batch.victim().rid == "old-low"
    batch.running = [req("high", 2, 0), req("higher", 3, 0)]
    assert batch.victim().rid == "high"


def test_queue_position_keeps_a_list_such_as_a_decodes_reservations_in_priority_order():
    prealloc: list[Req] = []
    for r in [req("a"), req("b", 3), req("c"), req("d", 3)]:
        prealloc.insert(queue_position(prealloc, r), r)
    assert [r.rid for r in prealloc] == ["b", "d", "a", "c"]
