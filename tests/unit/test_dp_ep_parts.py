"""DP attention and expert parallelism without a model (docs/dp-attention.md): expert placement, its
copies and EPLB's rebalance; the start-up checks of the flags; where a request goes among DP ranks; the
KV layout's DP and expert fields; the bootstrap's DP rank entries; and whole rooms between DP layouts
over the loopback backend from real KVPools, landing in the decode DP rank's pool only."""

from __future__ import annotations

import pytest
import torch

from bootstrap.registry import Registry, validate_registration
from common.config import ServerConfig
from common.core.request import Req
from common.engine.dp_scheduler import pick_dp_rank
from common.memory.kv_pool import KVPool
from common.parallel.experts import ExpertPlacement
from common.parallel.partition import TPSizeError, check_parallel
from common.wire.api import Rendezvous
from common.wire.kv_heads import rank_heads
from common.wire.kv_layout import experts_layout, layout_mismatch
from common.wire.sampling_params import SamplingParams
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


def test_experts_are_laid_out_whole_and_every_pair_has_one_owner_holding_it():
    plain = ExpertPlacement.initial(8, 2)
    assert plain.held == [[0, 1, 2, 3], [4, 5, 6, 7]]
    copies = ExpertPlacement.initial(8, 2, redundant=2)
    assert copies.held == [[0, 1, 2, 3, 4], [0, 1, 5, 6, 7]] and copies.holders(0) == [0, 1]
    chosen = torch.tensor([[0, 5], [0, 1], [1, 7], [2, 0]])
    owner = copies.owner(chosen, torch.arange(4))
    for (t, j), rank in zip([(t, j) for t in range(4) for j in range(2)], owner.flatten().tolist()):
        assert chosen[t, j].item() in copies.held[rank]
    assert owner[:, 0].tolist() == [0, 1, 0, 0]  # expert 0's tokens alternate between its two copies


def test_eplb_copies_the_hot_experts_to_the_idle_rank_and_keeps_a_placement_that_is_as_good():
    start = ExpertPlacement.initial(8, 2, redundant=2)
    loads = [0, 0, 100, 100, 100, 0, 0, 0]  # experts 2-4 live on rank 0 alone
    new = start.rebalance(loads)
    assert sorted(e for h in new.held for e in h) == sorted([*range(8), 2, 3])  # every expert, two copies
    assert all(len(h) == 5 and len(set(h)) == 5 for h in new.held)
    assert max(new.rank_loads(loads)) < max(start.rank_loads(loads)) == 300
    assert set(new.held[1]) & {2, 3, 4} and new.rebalance(loads) is new  # nothing better: no churn
    assert start.rebalance([0] * 8) is start  # nothing measured: nothing moves


def test_the_flags_that_cannot_split_the_model_or_each_other_are_refused():
    mla = (16, 1)
    check_parallel(4, 4, True, 0, mla, {"intermediate_size": 10}, (64, {"moe_intermediate_size": 3}))  # whole
    with pytest.raises(TPSizeError, match="--ep-size 2 needs a mixture-of-experts model"):
        check_parallel(2, 2, False, 0, (4, 2), {"intermediate_size": 128}, None)
    with pytest.raises(TPSizeError, match="--ep-size 3 does not divide the model's 8 experts"):
        check_parallel(3, 3, True, 0, mla, {}, (8, {}))
    with pytest.raises(TPSizeError, match="moe_intermediate_size 33 .*or give --ep-size 2"):
        check_parallel(2, 1, False, 0, mla, {}, (8, {"moe_intermediate_size": 33}))
    bad = {
        "--ep-size 2 must be 1 or --tp-size 4": dict(tp_size=4, ep_size=2),
        "--enable-dp-attention needs --dp-size equal to --tp-size": dict(
            tp_size=2, dp_size=1, enable_dp_attention=True
        ),
        "--dp-size 2 without --enable-dp-attention": dict(tp_size=2, dp_size=2),
        "need expert parallelism": dict(tp_size=2, enable_eplb=True),
        "not supported: run DP attention on one host": dict(
            tp_size=2, dp_size=2, enable_dp_attention=True, nnodes=2, dist_init_addr="h:1"
        ),
    }
    for message, flags in bad.items():
        with pytest.raises(ValueError, match=message):
            ServerConfig(**flags)
    assert ServerConfig(disaggregation_mode="decode").lb_method == "follow_bootstrap_room"
    assert ServerConfig().lb_method == "round_robin"


def test_a_request_goes_to_the_dp_rank_its_method_picks_once():
    def req(room: int | None = None, rank: int | None = None) -> Req:
        r = Req("r", [1, 2], SamplingParams(), data_parallel_rank=rank)
        r.rendezvous = Rendezvous("h", 1, room, None) if room is not None else None
        return r

    assert [pick_dp_rank("round_robin", req(), [0, 0, 0], t) for t in range(4)] == [0, 1, 2, 0]
    assert pick_dp_rank("minimum_tokens", req(), [30, 10, 10], 0) == 1
    assert pick_dp_rank("minimum_tokens", req(), [30, 10, 10], 2) == 2  # ties in turn
    assert pick_dp_rank("follow_bootstrap_room", req(room=7), [0, 0, 0], 0) == 7 % 3
    assert pick_dp_rank("follow_bootstrap_room", req(), [0, 0], 5) == 1  # no room: in turn
    assert pick_dp_rank("round_robin", req(rank=1), [0, 0], 0) == 1


def test_the_layout_states_dp_and_experts_which_may_differ_unless_attention_cannot_hold_the_heads():
    base = {"model_id": "m", "attention": "mha", "kv_heads": 2, "tp_size": 2, "dp_size": 1, "experts": "tp"}
    assert (
        experts_layout(64, 4, 0) == "ep 4"
        and experts_layout(8, 2, 2) == "ep 2 +2"
        and experts_layout(0, 1, 0) == "none"
    )
    assert layout_mismatch(base | {"dp_size": 2, "experts": "ep 2"}, base | {"tp_size": 4}) is None
    message = layout_mismatch(base, base | {"tp_size": 3})
    assert (
        "prefill attention (tp_size 3, dp_size 1): tp_size 3 neither divides nor is a multiple of kv_heads 2" in message
    )
    assert "decode layout: " in message and "prefill layout: " in message
    assert "dp_size 2 does not divide tp_size 3" in layout_mismatch(base | {"tp_size": 3, "dp_size": 2}, base)


def test_the_bootstrap_answers_a_prefills_dp_ranks():
    reg = Registry(None)
    entry = {"role": "Prefill", "instance_id": "p1", "rank_ip": "h", "rank_port": 9, "tp_size": 2, "dp_size": 2}
    entry |= {"page_size": 4, "num_layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "float32", "model_id": "m"}
    entry |= {"transfer_backend": "mooncake", "attention": "mla", "kv_scales": "none", "experts": "ep 2"}
    reg.register(validate_registration(entry | {"dp_rank": 0, "tp_rank": 0}))
    assert reg.by_instance("p1")["dp_ranks"] == [0]
    reg.register(validate_registration(entry | {"dp_rank": 1, "tp_rank": 1}))
    assert reg.by_instance("p1")["dp_ranks"] == [0, 1] and reg.by_rank(1, 1)["dp_rank"] == 1
    reg.remove("p1", (0, 0))
    assert reg.by_instance("p1") is None and reg.live_entries() == []


class Side:
    """A server's rank pools (each rank's attention group's share of the KV heads: every head under DP
    attention; a prefill's distinct per rank), and its manager on the loopback backend with its followers' agents."""

    def __init__(self, mode: str, kv_heads: int, tp: int, dp: int):
        heads = len(rank_heads(kv_heads, tp // dp, 0))
        self.pools = [KVPool(LAYERS, PAGES, PAGE, heads, DIM, torch.float32, "cpu") for _ in range(tp)]
        for rank, pool in enumerate(self.pools if mode == "prefill" else []):  # the decode's start empty
            pool.buffer.copy_(torch.arange(pool.buffer.numel(), dtype=torch.float32).view_as(pool.buffer) + 1e7 * rank)
        self.aux = torch.zeros(4, AUX, dtype=torch.uint8)
        serve = mode == "prefill"
        self.agents = [
            RankAgent(
                LoopbackBackend(),
                (p.buffer.data_ptr(), p.total_bytes, p.bytes_per_page),
                False,
                "127.0.0.1",
                None,
                serve=serve,
            )
            for p in self.pools[1:]
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
            aux_slots=4,
            kv_wait_timeout_s=3.0,
            tp_size=tp,
            kv_heads=kv_heads,
            dp_size=dp,
            rank_device_indices=[r.device_index for r in reports],
            rank_addresses=[r.backend_address for r in reports],
            rank_agents=[(r.agent_endpoint, r.agent_id) for r in reports if r.agent_endpoint],
        )
        self.manager = (PrefillKVManager if mode == "prefill" else DecodeKVManager)(self.args)


@pytest.mark.parametrize("prefill,decode", [((2, 2), (3, 3)), ((2, 2), (2, 1)), ((1, 1), (2, 2))])
def test_a_room_lands_in_its_decode_dp_ranks_pool_from_its_prefill_dp_ranks(prefill, decode):
    """(tp, dp) of each side: the room's KV is read from the prefill DP rank's attention group (its last
    one) and lands in the decode DP rank's group (its last one) only, every head in place."""
    kv_heads = 2
    p, d = Side("prefill", kv_heads, *prefill), Side("decode", kv_heads, *decode)
    src_dp, dst_dp = prefill[1] - 1, decode[1] - 1
    sender = KVSender(p.manager, 5, dp_rank=src_dp)
    receiver = KVReceiver(d.manager, 5, p.manager.endpoint, p.manager.instance_id)
    receiver.init([6, 2], aux_slot=3, dp_rank=dst_dp)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.send([1, 4], is_last=True, aux=bytes(range(AUX)))
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    src_attn, dst_attn = prefill[0] // prefill[1], decode[0] // decode[1]
    for rank, pool in enumerate(d.pools):
        group, local = divmod(rank, dst_attn)
        if group != dst_dp:
            assert pool.buffer[[6, 2]].abs().sum() == 0, f"decode rank {rank} is another DP rank's"
            continue
        for i, head in enumerate(rank_heads(kv_heads, dst_attn, local)):
            holder = src_dp * src_attn + head * src_attn // kv_heads if src_attn <= kv_heads else src_dp * src_attn
            src_local = list(rank_heads(kv_heads, src_attn, holder - src_dp * src_attn)).index(head)
            assert torch.equal(pool.buffer[[6, 2], i], p.pools[holder].buffer[[1, 4], src_local]), (rank, head)
    assert d.aux[3].tolist() == list(range(AUX))  # the record: decode rank 0's aux buffer, as always
