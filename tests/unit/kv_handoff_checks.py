"""What must hold after every step of the KV handoff's model (test_kv_handoff_model.py) on the simulated
pair (kv_handoff_pair.py), and at its end, when every process runs until quiet."""

from __future__ import annotations

import torch
from hypothesis.stateful import invariant

from common.memory.hicache import HiRadixCache
from tests.unit.kv_handoff_pair import BOUND_S, monolithic_answer
from tests.unit.kv_handoff_sim import Side


class HandoffInvariants:
    """Mixed into the state machine (its rules in test_kv_handoff_model.py) beside SimulatedPair."""

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def no_write_landed_in_a_page_its_room_does_not_own(self) -> None:
        assert not self.bad_writes, self.bad_writes

    @invariant()
    def pools_are_intact(self) -> None:
        for side in self._sides():
            side.sched.check_integrity()

    @invariant()
    def computed_kv_holds_its_tokens(self) -> None:
        for side in self._sides():
            kv = side.buffers[0]
            for layers, tree in self._trees(side):
                for layer in layers:
                    for node in tree._nodes():
                        assert layer[node.value].tolist() == node.key, "a prefix cache holds KV that was not computed"
            for req in side.sched.decode.running:
                slots = side.memory.req_pool.req_to_token[req.req_pool_idx, : req.kv_computed_len].to(torch.int64)
                assert kv[slots].tolist() == req.fill_ids[: req.kv_computed_len], (
                    f"request {req.rendezvous.room_id}: KV corrupted"
                )

    @staticmethod
    def _trees(side: Side) -> list[tuple[list[torch.Tensor], object]]:
        """(the KV layers a tree's slots index, the tree) for each tier of the side's prefix cache."""
        cache = side.memory.prefix_cache
        if not isinstance(cache, HiRadixCache):
            return [(side.buffers[:1], cache)]
        host = [cache.pool.buffer[:, i].reshape(-1) for i in range(cache.pool.buffer.shape[1])]
        return [(side.buffers, cache.device), (host, cache.host)]

    @invariant()
    def a_room_that_lost_a_rank_slice_succeeds_nowhere(self) -> None:
        """Success (on either side, or the decode running the request) only when every rank's slice of
        every page landed: a room whose batch lost one fails on both sides."""
        for p in self.pairs:
            if p.prefill.rendezvous.room_id in self.ranks.torn_rooms:
                for req in (p.prefill, p.decode):
                    assert not (req.finished and req.finish.type == "length"), "a torn room reported success"
                assert p.decode not in self.decode.sched.decode.running, "a torn room's request runs on the decode"

    @invariant()
    def successful_requests_have_the_monolithic_tokens(self) -> None:
        for p in self.pairs:
            r = p.decode
            if r.finished and r.finish.type == "length":
                assert r.output_ids == monolithic_answer(r.prompt_ids, r.params.max_new_tokens)

    # -- the end: everything runs until quiet ------------------------------------------------------
    def teardown(self) -> None:
        start = self.clock.now
        for side in self._sides():
            side.freeze(False)
        for _ in range(400):
            self._one_round()
            if all(p.ended("prefill") and p.ended("decode") for p in self.pairs) and self._idle():
                break
        for p in self.pairs:
            for half in ("prefill", "decode"):
                assert p.ended(half), f"room {p.prefill.rendezvous.room_id}: the {half} half never ended"
                at = p.finished_at.get(half)
                assert at is None or at <= max(start, getattr(p, half).arrival_time) + BOUND_S, f"{half} ended late"
        assert self._idle(), "pools, rooms or queues not back to idle"
        assert not self.bad_writes, self.bad_writes
