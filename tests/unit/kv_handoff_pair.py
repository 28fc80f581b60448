"""The simulated PD pair the KV handoff's model-based test drives (test_kv_handoff_model.py): a prefill and a
decode (kv_handoff_sim.py) on one clock and network, the decode's TP ranks (kv_handoff_ranks.py), the
client requests as the router splits them, and the checks every write passes through: each page or aux
slot written belongs to the writing room at that moment, and each page read was written by a forward
whose KV event the transfer waited on (a violation is recorded in `bad_writes`, which the invariants
read)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from common.core.request import Req
from common.wire.api import Rendezvous
from common.wire.sampling_params import SamplingParams
from decode_node.peers import PeerInfo
from tests.unit.kv_handoff_ranks import RankedWrites
from tests.unit.kv_handoff_sim import CONFIG, Clock, Network, Side, done_future
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


class SimulatedPair:
    """The cluster's state and what every rule and invariant of the model needs of it."""

    def __init__(self, decode_cache: bool = True) -> None:
        super().__init__()  # the state machine's, next in the test class's MRO
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
        self._cancel_other_halves()
        self.clock.now += 0.5

    def _cancel_other_halves(self) -> None:
        """What the router does: the half of a pair whose other half failed (aborted, or its process gone)
        is cancelled."""
        for p in self.pairs:
            for failed, other in (("prefill", "decode"), ("decode", "prefill")):
                req = getattr(p, failed)
                if (
                    not getattr(p, f"{failed}_side").alive or (req.finished and req.finish.type == "abort")
                ) and not p.ended(other):
                    getattr(p, f"{other}_side").sched.abort(getattr(p, other), f"{failed} half failed")

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
