"""A model-based test of the KV handoff: hypothesis drives a simulated prefill and decode (the processes:
kv_handoff_sim.py; the pair, its clients and its write checks: kv_handoff_pair.py; the invariants:
kv_handoff_checks.py; the rules, what can happen: here) through random interleavings of requests, next turns of finished ones (their prompt,
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

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from tests.unit.kv_handoff_checks import HandoffInvariants
from tests.unit.kv_handoff_pair import MAX_TURN_TOKENS, TURN_WAIT_ROUNDS, Pair, SimulatedPair, monolithic_answer
from tests.unit.kv_handoff_ranks import RankedWrites
from tests.unit.kv_handoff_sim import NUM_PAGES

__all__ = ["KVHandoff", "Pair", "monolithic_answer"]  # what the hand-picked cases drive


class KVHandoff(HandoffInvariants, SimulatedPair, RuleBasedStateMachine):
    """The rules: what can happen to the pair, in any order (the cluster: kv_handoff_pair.py; what must hold
    after each: kv_handoff_checks.py)."""

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
            self.decode.sched.retract(data.draw(st.sampled_from(batch.running)))
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
        self._cancel_other_halves()

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
