"""PD across TP sizes without a model: which prefill rank holds each decode rank's KV heads, the pieces
that move them (exact bytes, heads-first pages), whole rooms over the loopback backend from real
KVPools, and the refusal of a decode whose KV heads differ."""

from __future__ import annotations

import ctypes

import pytest
import torch

from common.memory.kv_pool import KVPool
from common.wire.kv_heads import Segment, head_sources, rank_heads
from tests.unit.kv_handoff_ranks import slice_triples
from tests.unit.test_transfer_protocol import wait_for
from transfer.backends.loopback import LoopbackBackend
from transfer.decode.decode_manager import DecodeKVManager
from transfer.decode.receiver import KVReceiver
from transfer.manager import KVArgs
from transfer.poll import KVPoll
from transfer.prefill.prefill_manager import PrefillKVManager
from transfer.prefill.sender import KVSender
from transfer.rank_agent import RankAgent

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
    """One server's rank pools (real KVPools, heads-first pages) and its manager on the loopback backend;
    each follower rank's own engine and agent (transfer.rank_agent, on real ZMQ sockets) in this process."""

    def __init__(self, mode: str, kv_heads: int, tp: int, devices: list[int] | None = None):
        """`devices`: the CUDA device each rank says its pool is on (the loopback engine ignores it)."""
        self.pools = rank_pools(kv_heads, tp)
        self.aux = torch.zeros(2, AUX, dtype=torch.uint8)
        self.agents = [
            RankAgent(
                LoopbackBackend(),
                (p.buffer.data_ptr(), p.total_bytes, p.bytes_per_page),
                False,
                "127.0.0.1",
                None,
                serve=mode == "prefill",
                device_index=(devices or [0] * tp)[rank],
            )
            for rank, p in enumerate(self.pools[1:], start=1)
        ]
        reports = [a.report() for a in self.agents]
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
            device_index=(devices or [0])[0],
            rank_addresses=[r.backend_address for r in reports],
            rank_device_indices=[r.device_index for r in reports],
            rank_agents=[(r.agent_endpoint, r.agent_id) for r in reports if r.agent_endpoint],
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
    """Each decode rank's slice is a group of its own and the status follows them all: a write into decode
    rank 2 that fails fails the room on both sides, and no success is ever reported for the other ranks."""
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
    assert dec.aux.sum() == 0  # the record goes after every group landed: never


def record_writes(backend, log: list, name: str, fail: list[str] = ()) -> None:
    """Log every batch `backend` writes as (name, pieces, carries the aux record); raise `fail`'s message
    instead while it holds one."""
    real = backend.write_batch

    def write(peer, src, dst, nbytes, on_device=False):
        if fail:
            raise RuntimeError(fail[0])
        log.append((name, len(src), AUX in nbytes))
        real(peer, src, dst, nbytes, on_device)

    backend.write_batch = write


def pair_room(prefill: Side, dec: Side, room: int) -> tuple[KVSender, KVReceiver]:
    sender = KVSender(prefill.manager, room)
    receiver = KVReceiver(dec.manager, room, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([5, 2], aux_slot=1)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.send([1, 2], is_last=True, aux=bytes(range(AUX)))
    return sender, receiver


def test_each_prefill_rank_writes_its_heads_with_its_own_engine_and_the_record_goes_last():
    """TP 3 -> 1: ranks 1 and 2 write their heads through their agents' own engines, rank 0 its own, all
    at once; the aux record follows once every group landed."""
    prefill, dec = Side("prefill", 3, 3), Side("decode", 3, 1)
    fill(prefill.pools, 3)
    writes: list = []
    for name, backend in [
        ("rank0", prefill.manager.backend),
        *((f"rank{r}", a.backend) for r, a in enumerate(prefill.agents, 1)),
    ]:
        record_writes(backend, writes, name)
    _, receiver = pair_room(prefill, dec, 11)
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    assert sorted(writes[:3]) == [("rank0", 2, False), ("rank1", 2, False), ("rank2", 2, False)]  # a piece per page
    assert writes[3:] == [("rank0", 1, True)]  # the record, after every group
    want = rank_pools(3, 1)
    fill(want, 3)
    assert torch.equal(dec.pools[0].buffer[[5, 2]], want[0].buffer[[1, 2]])
    head_page = prefill.pools[0].bytes_per_page
    assert [a.counters["bytes_sent"] for a in prefill.agents] == [2 * head_page] * 2
    assert dict(prefill.manager.writer.rank_bytes) == {0: 2 * head_page, 1: 2 * head_page, 2: 2 * head_page}
    metric = {m.name: m for m in prefill.manager.metrics.collect()}["tandem_kv_rank_bytes"]
    assert {s.labels["rank"]: s.value for s in metric.samples} == {
        "0": 2 * head_page,
        "1": 2 * head_page,
        "2": 2 * head_page,
    }


def test_one_follower_engine_failing_its_group_fails_the_room_and_no_record_lands():
    """All or nothing: rank 2's engine fails its group; the other groups still end before the status, the
    room fails on both sides naming rank 2, and the record is never written. Only that room: once the
    engine works again, the next room lands."""
    prefill, dec = Side("prefill", 3, 3), Side("decode", 3, 1)
    writes: list = []
    record_writes(prefill.manager.backend, writes, "rank0")
    record_writes(prefill.agents[0].backend, writes, "rank1")
    broken = ["rank 2's NIC is gone"]
    record_writes(prefill.agents[1].backend, writes, "rank2", fail=broken)
    sender, receiver = pair_room(prefill, dec, 12)
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert "tp rank 2's transfer engine failed" in receiver.failure_reason
    assert "rank 2's NIC is gone" in receiver.failure_reason
    assert sorted(writes) == [("rank0", 2, False), ("rank1", 2, False)]
    assert sender.poll() == KVPoll.Failed and dec.aux.sum() == 0
    broken.clear()
    _, receiver = pair_room(prefill, dec, 14)
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    assert dec.aux[1].tolist() == list(range(AUX))


def test_a_follower_that_does_not_answer_fails_the_room_when_the_tp_group_faults():
    """An agent whose process is gone answers nothing: the group fails as soon as rank 0's TP group
    names the fault, not after --transfer-timeout-s."""
    prefill, dec = Side("prefill", 3, 3), Side("decode", 3, 1)
    prefill.agents[1].control.close()  # rank 2's agent stops reading
    fault: list = []
    prefill.manager.links.fault = lambda: fault[0] if fault else None
    sender, receiver = pair_room(prefill, dec, 13)
    fault.append("tp rank 2 (pid 1) exited with code -9")
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert "tp rank 2 cannot write: tp rank 2 (pid 1) exited with code -9" in receiver.failure_reason
    assert dec.aux.sum() == 0


def test_every_engine_learns_each_decode_ranks_own_cuda_device():
    """Per-rank engines: the decode's Register names each rank's device, and whichever prefill engine
    writes into a decode rank (rank 0's, or a follower's through its agent) learns that rank's device
    (NIXL puts it on the remote descriptors: a pair of ranks may sit on different GPU indices)."""
    prefill, dec = Side("prefill", 2, 2, devices=[6, 7]), Side("decode", 2, 2, devices=[3, 1])
    learned = []
    for engine in (prefill.manager.backend, prefill.agents[0].backend):
        real = engine.add_peer
        engine.add_peer = lambda peer, address, device, real=real: (
            learned.append((peer[-1], device)) or real(peer, address, device)
        )
    fill(prefill.pools, 2)
    sender, receiver = pair_room(prefill, dec, 11)
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    assert prefill.manager.registrations[dec.manager.instance_id].device_indices == [3, 1]
    assert sorted(learned) == [("0", 3), ("1", 1), ("1", 1)]  # rank 0 learns both; follower 1 its own on use
