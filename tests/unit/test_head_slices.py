"""PD across TP sizes without a model: which prefill rank holds each decode rank's KV heads, the pieces
that move them (exact bytes, heads-first pages), whole rooms over the loopback backend from real
KVPools, and the refusal of a decode whose KV heads differ."""

from __future__ import annotations

import ctypes

import pytest
import torch

from common.memory.kv_pool import KVPool
from common.wire.kv_heads import Segment, head_sources, rank_heads
from tests.unit.test_transfer_protocol import wait_for
from transfer.decode.decode_manager import DecodeKVManager
from transfer.decode.receiver import KVReceiver
from transfer.manager import KVArgs
from transfer.poll import KVPoll
from transfer.prefill.prefill_manager import PrefillKVManager
from transfer.prefill.runs import slice_triples
from transfer.prefill.sender import KVSender

LAYERS, PAGES, PAGE, DIM, AUX = 2, 8, 4, 8, 32
LAYOUTS = [(3, 1, 3), (3, 3, 1), (4, 2, 4), (4, 4, 2), (2, 4, 2), (2, 2, 4), (2, 1, 4), (2, 4, 1), (3, 3, 3)]


def test_each_decode_rank_reads_its_heads_from_the_ranks_holding_them():
    assert head_sources(3, 1, 3) == [[Segment(0, 0, 0, 1)], [Segment(0, 1, 0, 1)], [Segment(0, 2, 0, 1)]]
    assert head_sources(3, 3, 1) == [[Segment(0, 0, 0, 1), Segment(1, 0, 1, 1), Segment(2, 0, 2, 1)]]
    assert head_sources(4, 2, 4) == [
        [Segment(0, 0, 0, 1)],
        [Segment(0, 1, 0, 1)],
        [Segment(1, 0, 0, 1)],
        [Segment(1, 1, 0, 1)],
    ]
    assert head_sources(4, 4, 2) == [
        [Segment(0, 0, 0, 1), Segment(1, 0, 1, 1)],
        [Segment(2, 0, 0, 1), Segment(3, 0, 1, 1)],
    ]
    # replicated on the prefill (4 ranks, 2 heads): the decode's one rank reads one replica of each
    assert head_sources(2, 4, 1) == [[Segment(0, 0, 0, 1), Segment(2, 0, 1, 1)]]
    # replicated on both at equal TP: rank r reads rank r
    assert [s[0].src_rank for s in head_sources(2, 4, 4)] == [0, 1, 2, 3]
    assert [list(rank_heads(2, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]


def rank_pools(kv_heads: int, tp: int) -> list[KVPool]:
    return [KVPool(LAYERS, PAGES, PAGE, len(rank_heads(kv_heads, tp, 0)), DIM, torch.float32, "cpu") for _ in range(tp)]


def fill(pools: list[KVPool], kv_heads: int) -> None:
    """Every value names its page, global head, layer, plane, slot and dim: a misplaced byte shows."""
    tp = len(pools)
    p, layer, c, s, d = torch.meshgrid(*(torch.arange(n) for n in (PAGES + 1, LAYERS, 2, PAGE, DIM)), indexing="ij")
    base = (p * 1e6 + layer * 1e4 + c * 1e3 + s * 10 + d * 0.01).float()
    for rank, pool in enumerate(pools):
        for local, head in enumerate(rank_heads(kv_heads, tp, rank)):
            pool.buffer[:, local] = base + head * 1e5


@pytest.mark.parametrize("kv_heads,src_tp,dst_tp", LAYOUTS)
def test_slices_land_every_head_of_every_decode_rank_exactly(kv_heads, src_tp, dst_tp):
    src, dst = rank_pools(kv_heads, src_tp), rank_pools(kv_heads, dst_tp)
    fill(src, kv_heads)
    src_pages, dst_pages = [1, 2, 3, 6], [8, 2, 3, 5]  # a run of two, and fragments
    head_bytes = src[0].bytes_per_page // src[0].kv_heads
    triples = slice_triples(
        [p.buffer.data_ptr() for p in src],
        [p.buffer.data_ptr() for p in dst],
        src[0].bytes_per_page,
        dst[0].bytes_per_page,
        head_bytes,
        head_sources(kv_heads, src_tp, dst_tp),
        src_pages,
        dst_pages,
    )
    for s, d, n in zip(*triples):
        ctypes.memmove(d, s, n)
    want = rank_pools(kv_heads, dst_tp)
    fill(want, kv_heads)
    for rank in range(dst_tp):
        assert torch.equal(dst[rank].buffer[dst_pages], want[rank].buffer[src_pages]), f"decode rank {rank}"
        untouched = [p for p in range(PAGES + 1) if p not in dst_pages]
        assert dst[rank].buffer[untouched].abs().sum() == 0
    assert sum(triples[2]) == len(src_pages) * dst[0].bytes_per_page * dst_tp


def test_a_head_slice_is_one_piece_per_page_and_whole_pages_stay_runs():
    """2k tokens (128 pages, fragmented on the decode): 1 -> 3 is a piece per page per decode rank; at
    equal head counts per rank (a replicated 2 -> 4) runs merge as at equal TP."""
    src, dst = list(range(1, 129)), list(range(1, 257, 2))
    plan = head_sources(3, 1, 3)
    assert len(slice_triples([0], [0, 0, 0], 3, 1, 1, plan, src, dst)[0]) == 128 * 3
    assert len(slice_triples([0], [0, 0, 0], 3, 1, 1, plan, src, src)[0]) == 128 * 3
    plan = head_sources(1, 2, 4)  # one head everywhere: whole pages on both sides
    assert len(slice_triples([0, 0], [0] * 4, 1, 1, 1, plan, src, src)[0]) == 4


class Side:
    """One server's rank pools (real KVPools, heads-first pages) and its manager on the loopback backend."""

    def __init__(self, mode: str, kv_heads: int, tp: int):
        self.pools = rank_pools(kv_heads, tp)
        self.aux = torch.zeros(2, AUX, dtype=torch.uint8)
        self.args = KVArgs(
            [p.buffer.data_ptr() for p in self.pools],
            [p.total_bytes for p in self.pools],
            [p.bytes_per_page for p in self.pools],
            PAGES,
            PAGE,
            backend="loopback",
            aux_ptr=self.aux.data_ptr(),
            aux_record_bytes=AUX,
            aux_slots=2,
            kv_wait_timeout_s=3.0,
            tp_size=tp,
            kv_heads=kv_heads,
        )
        self.manager = (PrefillKVManager if mode == "prefill" else DecodeKVManager)(self.args)


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 3), (3, 1)])
def test_a_room_between_tp_sizes_lands_each_ranks_heads_and_the_record_once(src_tp, dst_tp):
    prefill, dec = Side("prefill", 3, src_tp), Side("decode", 3, dst_tp)
    fill(prefill.pools, 3)
    sender = KVSender(prefill.manager, 7)
    receiver = KVReceiver(dec.manager, 7, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([5, 2, 3], aux_slot=1)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.send([1, 2], is_last=False, aux=None)
    sender.send([4], is_last=True, aux=bytes(range(AUX)))
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    want = rank_pools(3, dst_tp)
    fill(want, 3)
    for rank in range(dst_tp):
        assert torch.equal(dec.pools[rank].buffer[[5, 2, 3]], want[rank].buffer[[1, 2, 4]])
    assert dec.aux[1].tolist() == list(range(AUX)) and dec.aux[0].sum() == 0
    assert prefill.manager.counters["bytes_sent"] == 3 * dec.pools[0].bytes_per_page * dst_tp


def test_a_decode_splitting_other_kv_heads_is_refused_naming_both():
    prefill, dec = Side("prefill", 3, 1), Side("decode", 4, 2)
    receiver = KVReceiver(dec.manager, 9, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([1], aux_slot=0)
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert "kv_heads: decode has 4, prefill has 3" in receiver.failure_reason
    assert prefill.manager.counters["peers_refused"] == 1


def test_one_decode_ranks_failed_write_fails_the_room_for_every_rank():
    """Every rank's slice goes in one backend batch and the status follows it: a write into decode rank 2
    that fails fails the room on both sides, and no success is ever reported for the other ranks."""
    prefill, dec = Side("prefill", 3, 1), Side("decode", 3, 3)
    rank2 = dec.pools[2].buffer
    lo, hi = rank2.data_ptr(), rank2.data_ptr() + dec.pools[2].total_bytes
    backend = prefill.manager.backend
    real = backend.write_batch

    def failing(peer, src, dst, nbytes, on_device=False):
        if any(lo <= d < hi for d in dst):
            raise RuntimeError("write into decode rank 2 failed")
        real(peer, src, dst, nbytes, on_device)

    backend.write_batch = failing
    sender = KVSender(prefill.manager, 8)
    receiver = KVReceiver(dec.manager, 8, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([1, 2], aux_slot=0)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.send([3, 4], is_last=True, aux=bytes(AUX))
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert "write into decode rank 2 failed" in receiver.failure_reason
    assert sender.poll() == KVPoll.Failed and prefill.manager.counters["rooms_succeeded"] == 0
    assert dec.aux.sum() == 0  # the record travels in the same batch: it never landed
