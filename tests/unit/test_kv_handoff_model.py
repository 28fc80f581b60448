"""A model-based test of the KV handoff: hypothesis drives a simulated prefill and decode (see
kv_handoff_sim.py) through random interleavings of requests, next turns of finished ones (their prompt,
answer and new tokens: both sides' prefix caches hit, the decode's with the answer too, and evict under
the small pools), prefill chunks, transfers, control messages delivered late, twice or never, aborts
from either side (a decode's room aborted mid-transfer drains in quarantine), retractions of running
decode requests while other rooms transfer, timeouts, heartbeats, frozen, killed and restarted peers.
Each side runs with or without a host tier (either write policy; drawn per example), and the decode with
1, 2 or 4 TP ranks, each write going out as the ranks' head slices, one of which can fail
(kv_handoff_ranks.py). After every step it checks:

- every pool's integrity on both tiers: each page free, cached, or held by exactly one request (nothing
  freed twice: the allocator raises on a double free), each host page free or in the host tree;
- no write lands in a page (or aux slot) that the written room does not own at that moment (a decode's
  cached prefix, locked in its radix cache, is never a room's: only the pages past it are);
- every KV slot the caches (device and host trees) or requests count as computed holds exactly its
  token's KV;
- every request that succeeded got exactly the tokens a monolithic server gives;
- a room whose write lost one rank's slice succeeds on neither side (nor runs on the decode);

and at the end, with every process running, that each request ended within its bound and every pool,
room and queue is back to idle. Set TANDEM_MODEL_SEED to explore other schedules; a failure prints its
example (and how to reproduce it).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.core.request import Req
from common.memory.hicache import HiRadixCache
from common.wire.api import Rendezvous
from common.wire.sampling_params import SamplingParams
from decode_node.peers import PeerInfo
from tests.unit.kv_handoff_ranks import RankedWrites
from tests.unit.kv_handoff_sim import CONFIG, NUM_PAGES, Clock, Network, Side, done_future
from transfer.prefill.kv_writer import rank_peer

MAX_TURN_TOKENS = 56  # within the simulated context (64)
TURN_WAIT_ROUNDS = 12  # a next turn waits this many rounds of everything at most for the last one's answer
BOUND_S = CONFIG.pairing_timeout_s + CONFIG.kv_wait_timeout_s + CONFIG.transfer_timeout_s + 30


def monolithic_answer(prompt: list[int], max_new: int) -> list[int]:
    """The fake model's greedy output: each token the last one + 1."""
    return [(prompt[-1] + i) % 1000 for i in range(1, max_new + 1)]


@dataclass(eq=False)
class Pair:
    """One client request as the router splits it: the same body to a prefill and a decode."""

    prefill: Req
    decode: Req
    prefill_side: Side
    decode_side: Side
    finished_at: dict[str, float]

    def ended(self, half: str) -> bool:
        side, req = (self.prefill_side, self.prefill) if half == "prefill" else (self.decode_side, self.decode)
        return req.finished or not side.alive  # a dead process's clients got an error from the router


class KVHandoff(RuleBasedStateMachine):
    def __init__(self, decode_cache: bool = True) -> None:
        super().__init__()
        self.decode_cache = decode_cache  # False: the decode runs with --disable-radix-cache
        self.host_tier: dict[str, str | None] = {"prefill": None, "decode": None}  # a write policy, or no host tier
        self.clock = Clock()
        self.net = Network(self.clock)
        self.ranks = RankedWrites(1)
        self.prefill = self._new_prefill()
        self.decode = self._new_decode()
        self.pairs: list[Pair] = []
        self.rooms = itertools.count(1)
        self.bad_writes: list[str] = []

    # -- the simulated cluster -------------------------------------------------------------------
    def _new_prefill(self) -> Side:
        side = Side(self.net, self.clock, "prefill", host_tier=self.host_tier["prefill"])
        real_write, side.writing = side.manager._write, None

        def write(chunk):
            side.writing = chunk.room.room_id
            try:
                real_write(chunk)
            finally:
                side.writing = None

        side.manager._write = write
        real_batch = side.manager.backend.write_batch
        side.manager.backend.write_batch = lambda peer, src, dst, n, *a: self._checked_write(
            side, peer, dst, n, lambda *w: self._rank_write(side, real_batch, *w), src, *a
        )
        return side

    def _new_decode(self) -> Side:
        host_tier = self.host_tier["decode"] if self.decode_cache else None
        return Side(
            self.net, self.clock, "decode", lookup=self._lookup, prefix_cache=self.decode_cache, host_tier=host_tier
        )

    def _lookup(self, rendezvous: Rendezvous):
        p = self.prefill
        if not p.alive or rendezvous.prefill_instance_id != p.manager.instance_id:
            return done_future(error=RuntimeError(f"prefill {rendezvous.prefill_instance_id} is not registered"))
        return done_future(PeerInfo(p.manager.endpoint, p.manager.instance_id))

    def _checked_write(self, side: Side, peer: str, dst: list[int], nbytes: list[int], real, src, *args) -> None:
        dec = self.decode
        if not dec.alive or peer != rank_peer(dec.manager.instance_id, 0):
            raise ConnectionError("the decode process is gone")
        self._check_read_order(side, src, nbytes)
        owner = self._decode_owners()
        a = dec.manager.args
        for d, n in zip(dst, nbytes):
            if a.aux_ptr <= d < a.aux_ptr + a.aux_slots * a.aux_record_bytes:
                targets = [("aux", (d - a.aux_ptr) // a.aux_record_bytes)]
            else:
                base = max(b for b in a.kv_ptrs if b <= d)
                first = (d - base) // a.bytes_per_page[0]
                targets = [("page", p) for p in range(first, first + n // a.bytes_per_page[0])]
            for t in targets:
                if owner.get(t) != side.writing:  # recorded: the worker would turn an exception into a room failure
                    self.bad_writes.append(f"room {side.writing} wrote {t}, which room {owner.get(t)} owns")
        real(peer, src, dst, nbytes, *args)

    def _rank_write(self, side: Side, real, *write) -> None:
        """The batch as the decode's ranks' slices (kv_handoff_ranks.py)."""
        a, d = side.manager.args, self.decode.manager.args
        self.ranks.write(real, side.writing, a.kv_ptrs, d.kv_ptrs, d.kv_nbytes, *write)

    def _check_read_order(self, side: Side, src: list[int], nbytes: list[int]) -> None:
        """Every page read was written by a forward whose KV event the transfer waited on first."""
        a, page_bytes = side.manager.args, side.manager.args.bytes_per_page[0]
        for s, n in zip(src, nbytes):
            base = max((b for b in a.kv_ptrs if b <= s), default=None)
            if base is None or s >= base + a.kv_nbytes[a.kv_ptrs.index(base)]:
                continue  # the aux record, from host staging
            first = (s - base) // page_bytes
            for page in side.runner.events.unwaited(list(range(first, first + n // page_bytes))):
                self.bad_writes.append(f"room {side.writing} read page {page} before its forward's KV event")

    def _decode_owners(self) -> dict[tuple[str, int], int]:
        """(page or aux slot) -> the room whose transfer may write it right now."""
        owner: dict[tuple[str, int], int] = {}
        role, memory = self.decode.sched.role, self.decode.memory
        for req, inb in role.inbound.items():
            if inb.receiver is not None and inb.receiver.room.requested and req.req_pool_idx is not None:
                for page in memory.page_ids(req, req.cached_len, req.kv_len):
                    owner[("page", page)] = inb.receiver.room_id
                owner[("aux", inb.aux_slot)] = inb.receiver.room_id
        return owner

    def _sides(self) -> list[Side]:
        return [self.prefill, self.decode]

    # -- rules -------------------------------------------------------------------------------------
    @initialize(
        tiers=st.sampled_from([None, "write_through", "write_back"]),
        both=st.booleans(),
        ranks=st.sampled_from([1, 2, 4]),
    )
    def choose_host_tiers(self, tiers: str | None, both: bool, ranks: int) -> None:
        """The host tier on the decode (where retraction uses it), and on the prefill too if `both`; the
        decode's TP ranks, each written its own slice of every page."""
        self.ranks = RankedWrites(ranks)
        self.host_tier = {"prefill": tiers if both else None, "decode": tiers}
        self.prefill.kill()
        self.decode.kill()
        self.prefill, self.decode = self._new_prefill(), self._new_decode()

    @precondition(lambda self: self.prefill.alive and self.decode.alive)
    @rule(prompt_len=st.integers(1, 30), max_new=st.integers(0, 6), stream_first=st.booleans())
    def new_request(self, prompt_len: int, max_new: int, stream_first: bool) -> None:
        self._submit([(7 * len(self.pairs) + i) % 500 + 1 for i in range(prompt_len)], max_new)

    @precondition(lambda self: self.prefill.alive and self.decode.alive and self._conversations())
    @rule(data=st.data())
    def next_turn(self, data) -> None:
        """A conversation goes on once its last turn is answered (a few rounds of everything at most):
        that request's prompt and answer (the monolithic one; in the decode's cache if it succeeded
        there), then new tokens."""
        pair = data.draw(st.sampled_from(self._conversations()))
        for _ in range(TURN_WAIT_ROUNDS):
            if pair.ended("decode") or not (self.prefill.runs and self.decode.runs):
                break
            self._one_round(only_running=True)
        prev = pair.decode
        history = prev.prompt_ids + monolithic_answer(prev.prompt_ids, prev.params.max_new_tokens)
        new_len = data.draw(st.integers(1, min(9, MAX_TURN_TOKENS - len(history) - 1)))
        max_new = data.draw(st.integers(1, MAX_TURN_TOKENS - len(history) - new_len))
        self._submit(history + [(11 * len(self.pairs) + i) % 500 + 1 for i in range(new_len)], max_new)

    def _conversations(self) -> list[Pair]:
        """Requests with an answer that a next turn (a new token and one to generate) still fits: those
        answered already if any (their history is in the decode's cache), else those still running."""
        fits = [
            p
            for p in self.pairs
            if p.decode.params.max_new_tokens
            and len(p.decode.prompt_ids) + p.decode.params.max_new_tokens + 2 <= MAX_TURN_TOKENS
        ]
        done = [p for p in fits if p.decode.finished and p.decode.finish.type == "length"]
        return done or [p for p in fits if not p.decode.finished]

    def _submit(self, prompt: list[int], max_new: int) -> None:
        rendezvous = Rendezvous("sim", 1, next(self.rooms), self.prefill.manager.instance_id)
        pair = Pair(*(self._req(prompt, max_new, rendezvous) for _ in range(2)), self.prefill, self.decode, {})
        for half, req, side in (("prefill", pair.prefill, self.prefill), ("decode", pair.decode, self.decode)):
            req.sink = lambda ev, half=half: pair.finished_at.setdefault(half, self.clock.now) if ev.finish else None
            side.sched.submit(req)
        self.pairs.append(pair)

    def _req(self, prompt: list[int], max_new: int, rendezvous: Rendezvous) -> Req:
        req = Req(
            "same-rid-for-all", prompt, SamplingParams(max_new_tokens=max_new, temperature=0), rendezvous=rendezvous
        )
        req.arrival_time = self.clock.now
        return req

    @rule(which=st.sampled_from(["prefill", "decode"]))
    def step(self, which: str) -> None:
        side = getattr(self, which)
        if side.runs:
            side.sched.step()

    @rule(which=st.sampled_from(["prefill", "decode"]))
    def step_with_a_failing_forward(self, which: str) -> None:
        side = getattr(self, which)
        if side.runs:
            side.runner.fail_next = True
            side.sched.step()
            side.runner.fail_next = False

    @precondition(lambda self: self.decode.runs and any(not p.ended("decode") for p in self.pairs))
    @rule(data=st.data(), evict=st.booleans())
    def decode_retracts(self, data, evict: bool) -> None:
        """The decode retracts a running request (after rounds of everything until one runs, a few at most),
        as when the batch's next tokens do not fit, while other rooms transfer: its KV goes back to the
        prefix cache, with `evict` on at once out of the device tree (to the host tier if there is one), and
        it queues again and resumes from there."""
        batch = self.decode.sched.decode
        for _ in range(TURN_WAIT_ROUNDS):
            if batch.running or not (self.prefill.runs and self.decode.runs):
                break
            self._one_round(only_running=True)
        if batch.running and self.decode.runs:
            batch.retract(data.draw(st.sampled_from(batch.running)))
            if evict:
                self.decode.memory.prefix_cache.evict(NUM_PAGES)

    @rule(which=st.sampled_from(["prefill", "decode"]), pages=st.integers(1, NUM_PAGES))
    def cache_pressure(self, which: str, pages: int) -> None:
        """The device tree evicts its least recently used pages, as a short allocation makes it (to the host
        tier first when there is one): later matches of them load them back or recompute them."""
        side = getattr(self, which)
        if side.runs:
            side.memory.prefix_cache.evict(pages)

    @rule()
    def run_transfers(self) -> None:
        if self.prefill.runs:
            self.prefill.run_transfers()

    @rule(which=st.sampled_from(["prefill", "decode"]))
    def heartbeat(self, which: str) -> None:
        side = getattr(self, which)
        if side.runs:
            side.manager.heartbeat_tick()

    @rule(data=st.data())
    def deliver_a_frame(self, data) -> None:
        ready = self.net.deliverable()
        if ready:
            self.net.deliver(data.draw(st.sampled_from(ready)))

    @rule(data=st.data())
    def lose_a_frame(self, data) -> None:
        ready = self.net.deliverable()
        if ready:
            self.net.in_flight.pop(data.draw(st.sampled_from(ready)))

    @rule(data=st.data())
    def replay_a_frame(self, data) -> None:
        if self.net.delivered:
            self.net.replay(data.draw(st.integers(0, len(self.net.delivered) - 1)))

    @rule(data=st.data(), half=st.sampled_from(["prefill", "decode"]))
    def client_goes_away(self, data, half: str) -> None:
        live = [p for p in self.pairs if not p.ended(half)]
        if live:
            pair = data.draw(st.sampled_from(live))
            getattr(pair, f"{half}_side").sched.abort(getattr(pair, half), "client went away")

    @rule()
    def router_cancels_the_other_half(self) -> None:
        for p in self.pairs:
            for failed, other in (("prefill", "decode"), ("decode", "prefill")):
                req = getattr(p, failed)
                if (
                    not getattr(p, f"{failed}_side").alive or (req.finished and req.finish.type == "abort")
                ) and not p.ended(other):
                    getattr(p, f"{other}_side").sched.abort(getattr(p, other), f"{failed} half failed")

    @rule()
    def a_round_of_everything(self) -> None:
        """Every running process does one of each thing; frozen and dead ones nothing."""
        self._one_round(only_running=True)

    @rule()
    def prefill_freezes_mid_transfer(self) -> None:
        if self.prefill.runs and any(w.chunks for w in self.prefill.manager.workers.alive()):
            self.prefill.freeze(True)

    @rule(rank=st.integers(0, 3))
    def a_rank_write_fails(self, rank: int) -> None:
        """The next write batch with KV loses decode rank `rank`'s slice (of the decode's ranks): every
        other slice lands, and the batch raises."""
        self.ranks.failing_rank = rank % self.ranks.ranks

    @rule(dt=st.sampled_from([0.3, 1.0, 2.5, 7.0, 25.0]))
    def time_passes(self, dt: float) -> None:
        self.clock.now += dt

    @rule(which=st.sampled_from(["prefill", "decode"]), frozen=st.booleans())
    def freeze_or_thaw(self, which: str, frozen: bool) -> None:
        side = getattr(self, which)
        if side.alive:
            side.freeze(frozen)

    @rule(which=st.sampled_from(["prefill", "decode"]))
    def kill_and_restart(self, which: str) -> None:
        getattr(self, which).kill()
        setattr(self, which, self._new_prefill() if which == "prefill" else self._new_decode())

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

    def _one_round(self, only_running: bool = False) -> None:
        """Frames delivered, transfers run, heartbeats, one scheduler step each (in that order, so chunks a
        step queues wait for the next round), then half a second passes."""
        while self.net.deliverable():
            self.net.deliver(0)
        sides = [s for s in self._sides() if s.runs or not only_running]
        if self.prefill in sides:
            self.prefill.run_transfers()
        for side in sides:
            side.manager.heartbeat_tick()
            side.sched.step()
        self.router_cancels_the_other_half()
        self.clock.now += 0.5

    def _idle(self) -> bool:
        for side in self._sides():
            counts = side.sched.check_integrity()
            if counts.owned or counts.locked or side.sched.tracked_requests():
                return False
        dec_role, pre = self.decode.sched.role, self.prefill.manager
        workers_busy = any(w.chunks or w.owed for w in pre.workers.alive())
        owned_rooms = [r for r in pre.table.snapshot() if r.owned]
        return not (
            dec_role.inbound or self.decode.manager.table.rooms or workers_busy or owned_rooms or self.net.deliverable()
        )


KVHandoff.TestCase.settings = settings(  # max_examples: the Hypothesis profile's (tests/tiers.py)
    stateful_step_count=50,
    deadline=None,
    derandomize="TANDEM_MODEL_SEED" not in os.environ,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
if "TANDEM_MODEL_SEED" in os.environ:
    from hypothesis import seed

    KVHandoff.TestCase = seed(int(os.environ["TANDEM_MODEL_SEED"]))(KVHandoff.TestCase)
TestKVHandoff = KVHandoff.TestCase
