"""Decode role: find the request's prefill peer, pre-allocate a row, match the prompt in the prefix
cache (the pages of earlier requests: a conversation's last turn, prompt and answer), reserve KV pages
for the rest of the prompt and an aux slot, tell prefill where to write and from which page-aligned
token on (`cached_prefix_len`: it sends only the pages this decode lacks), commit the first token as
soon as the prefill sends its aux record ahead of the KV (FirstToken), wait for Success and join the
decode batch with no prefill forward.
The same record comes with the KV: it must equal the one sent ahead; if that one was lost, the first
token is committed from it at Success. A first token that ends the request ends it at Success, so the
prefill's writes finish normally.

    prealloc --(row, cached prefix locked, pages for the rest,  --> transferring --(Success)--> decode batch
      nothing held (a room claimed)    aux slot; receiver.init)    row + prompt KV + aux slot
                                                                  first token streamed on FirstToken
                                                                         |
                                                     (failed / aborted before the prefill's status)
                                                                         v
                                 quarantined: the client already has its error; row, pages and aux slot
                                    wait until no write of the prefill can land in them (its status
                                    arrived, or one heartbeat interval after it was declared dead, see
                                    transfer/decode/decode_rooms.py), or --transfer-timeout-s, then are freed

A request with max_new_tokens 0 needs nothing from a prefill: it ends at once with no tokens. A request the
router placed here (`pd_placement` local, docs/placement.md) has no prefill either: the scheduler computes its
prompt in chunks, as a monolithic server does, taking turns with the decode batch (`interleave_prefill`), and it
never enters the role's queues. One placed `remote_full` matches nothing in the prefix cache: the whole prompt
crosses.

A room whose KV does not arrive whole (its prefill declared dead, the transfer failed or timed out, a checksum
differed) fails its request (502 or 504: the router moves it to another pair), or with
--kv-load-failure-policy recompute (vLLM's) the request is computed here: a husk takes over the room's row
and pages (quarantined as above), and the request, with the first token it may have streamed, joins this
server's prefill queue as a retracted one would.

Who frees what: every exit goes through Scheduler.finish -> release() here. Without a transfer in flight
the row and pages go back at once (MemoryManager.release caches only KV marked computed, and a transfer
that never completed marked none); with one, release() keeps them (quarantined) and _poll_quarantined frees
them through Scheduler.free; the aux slot and the room go with the pages.

    a decode request's prompt slots   held as                            at release
    [0, cached)                       radix pages it matched, locked     unlocked (never written by the room)
    [cached, n) before Success        its own pages, the room's target   freed, never cached (after the
                                                                         quarantine when a write may land)
    [cached, n) after Success         its own pages, KV arrived          whole pages into the radix cache

The prefill writes only into [cached, n): pages no other request holds and eviction cannot reach (they
are not in the tree), so a late write lands in pages nobody reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from common.config import ServerConfig
from common.core.request import FinishReason, Req, ReqStatus, queue_position
from common.engine.decode_reserve import decode_reserve
from common.engine.pd_role import PDRole
from common.engine.role import SchedulerView
from common.engine.spec.head_drafter import HiddenHandoff
from common.memory.errors import MemoryIntegrityError
from common.wire.api import Rendezvous
from decode_node.peers import PeerInfo
from transfer.aux_record import RECORD_BYTES, AuxRecord
from transfer.decode.aux_pool import AuxPool
from transfer.decode.decode_manager import DecodeKVManager
from transfer.decode.receiver import KVReceiver
from transfer.poll import DuplicateRoom, KVPoll

log = logging.getLogger(__name__)
Lookup = Callable[[Rendezvous], "Future[PeerInfo]"]


@dataclass(eq=False)
class Inbound:
    """One request's transfer: where its prefill is, the room it waits on, its aux slot."""

    lookup: Future[PeerInfo]
    receiver: KVReceiver | None = None
    aux_slot: int | None = None
    quarantine_deadline: float | None = None
    committed_ahead: bytes | None = None  # the aux record whose first token was committed (ahead of the KV, or with it)
    finish_ahead: FinishReason | None = None  # that token ended the request: it ends once the KV is in


class DecodeRole(PDRole):
    mode = "decode"
    kv_manager: DecodeKVManager
    interleave_prefill = True  # the running batch's next token is not held up by a whole local prompt

    def __init__(
        self,
        scheduler: SchedulerView,
        kv_manager: DecodeKVManager,
        aux_pool: AuxPool,
        lookup: Lookup,
        vocab_size: int,
        config: ServerConfig,
        hidden: HiddenHandoff | None = None,
    ):
        """`hidden`: NEXTN's or EAGLE's drafter, which takes the prompt's last hidden state from the aux record."""
        super().__init__(kv_manager)
        self.scheduler, self.aux_pool, self.hidden = scheduler, aux_pool, hidden
        self.lookup, self.vocab_size, self.config = lookup, vocab_size, config
        self.prealloc: list[Req] = []
        self.transferring: list[Req] = []
        self.quarantined: list[Req] = []  # ended; their pages wait until no write can land in them
        self.inbound: dict[Req, Inbound] = {}

    def admit(self, req: Req) -> bool:
        if req.pd_placement == "local":
            return False  # computed here, in chunks, like a monolithic server's (docs/placement.md)
        if req.params.max_new_tokens == 0:
            self.scheduler.finish(req, FinishReason("length"))  # the prefill alone answers the prompt's part
        else:
            lookup = self.lookup(req.rendezvous)  # done already when the peer directory knew the answer
            lookup.add_done_callback(lambda done: self._peer_found(req, done))
            self.inbound[req] = Inbound(lookup)
            req.status = ReqStatus.PAIRING
            self.prealloc.insert(queue_position(self.prealloc, req), req)  # by priority, then FIFO
        return True

    def _peer_found(self, req: Req, lookup: Future[PeerInfo]) -> None:
        """The lookup ended, on its thread (or this one, for a cached answer): the next step goes on."""
        if lookup.exception() is None:
            req.timeline.mark("peer_found")
        self.scheduler.wake()

    # -- queues --------------------------------------------------------------------------------
    def poll(self) -> None:
        s = self.scheduler
        for req in list(self.prealloc):
            if s.guarded(req, "reserving memory", lambda: self._poll_prealloc(req)) is False:
                break  # FIFO: wait for memory before reserving for later requests
        for req in list(self.transferring):
            s.guarded(req, "waiting for the KV", lambda: self._poll_transfer(req))
        for req in list(self.quarantined):
            self._poll_quarantined(req)

    def _poll_prealloc(self, req: Req) -> bool:
        """False while the request waits for memory."""
        inb = self.inbound[req]
        if self.scheduler.clock() - req.arrival_time > self.config.pairing_timeout_s:
            self.scheduler.fail(
                req,
                f"could not reserve memory or reach the prefill peer within {self.config.pairing_timeout_s:g} s",
                504,
            )
        elif inb.lookup.done():
            if inb.lookup.exception() is not None:
                self._kv_load_failed(req, inb, f"prefill peer lookup failed: {inb.lookup.exception()}")
            else:
                return self._try_prealloc(req, inb, inb.lookup.result())
        return True

    def _try_prealloc(self, req: Req, inb: Inbound, peer: PeerInfo) -> bool:
        if inb.receiver is None:
            try:
                inb.receiver = KVReceiver(
                    self.kv_manager, req.rendezvous.room_id, peer.endpoint, peer.instance_id, req.timeline.mark
                )
            except DuplicateRoom as e:
                self.scheduler.fail(req, str(e), 409)
                return True
        if inb.receiver.failure_reason is not None:  # failed before it was requested: its prefill was declared dead
            self._kv_load_failed(req, inb, f"KV transfer failed: {inb.receiver.failure_reason}")
            return True
        memory, n = self.scheduler.memory, len(req.prompt_ids)
        if (
            self.scheduler.starved()
            or self.scheduler.rows_left() <= 0
            or not memory.can_admit()
            or not self.aux_pool.can_alloc()
            or not (self.scheduler.lora is None or self.scheduler.lora.can_admit(req))  # its adapter's slot
        ):
            return False
        if self.scheduler.lora is not None:
            self.scheduler.lora.admit(req)
        # the prefix cache's hit, locked until release (none for remote_full: the whole prompt crosses); at least
        # one page crosses
        memory.admit(req, 0 if req.pd_placement == "remote_full" else n - 1)
        cached = req.cached_len
        if not memory.can_extend(req, n - cached + decode_reserve(req)):
            memory.release(req)
            if self.scheduler.lora is not None:
                self.scheduler.lora.release(req)
            return False
        memory.extend(req, n - cached)
        req.decode_hit_len = cached
        req.timeline.mark("pages_reserved")
        inb.aux_slot = self.aux_pool.alloc()
        # sends nothing if the room failed meanwhile: the next poll ends it
        inb.receiver.init(memory.page_ids(req, cached, n), inb.aux_slot, cached, self.scheduler.dp_rank, req.lora or "")
        self.prealloc.remove(req)
        req.status = ReqStatus.TRANSFERRING
        self.transferring.append(req)
        return True

    def _poll_transfer(self, req: Req) -> None:
        inb = self.inbound[req]
        state = inb.receiver.poll()
        if state == KVPoll.Success:
            self._kv_arrived(req, inb)
        elif state == KVPoll.Failed:
            self._kv_load_failed(req, inb, f"KV transfer failed: {inb.receiver.failure_reason}")
        elif inb.committed_ahead is None and inb.receiver.first_record is not None:
            self._commit_first_token(req, inb, inb.receiver.first_record)

    def _commit_first_token(self, req: Req, inb: Inbound, raw: bytes) -> None:
        """Stream the first token of the aux record `raw` (sent ahead of the KV, or the one that came with
        it); the request joins the decode batch, or ends when this token ended it, once the KV is in."""
        rec = self._valid_record(req, raw)
        if rec is None:
            return
        inb.committed_ahead = raw
        req.prefix_hit_len = rec.cached_tokens
        inb.finish_ahead = self.scheduler.commit_token(
            req, rec.first_token, rec.logprob, rec.top_logprobs, from_peer=True
        )

    def _kv_arrived(self, req: Req, inb: Inbound) -> None:
        raw = self.aux_pool.read(inb.aux_slot)
        if inb.committed_ahead is None:  # the record sent ahead was lost: the first token comes from this one
            self._commit_first_token(req, inb, raw)
            if req.finished:
                return
        elif raw != inb.committed_ahead:
            self.scheduler.fail(
                req, "invalid aux record from prefill: it differs from the one sent ahead of the KV", 502
            )
            return
        self.transferring.remove(req)
        self._drop_transfer_state(req)
        self.scheduler.memory.mark_computed(req)  # the prompt's KV arrived whole
        if self.hidden is not None:  # a head's first input (its KV for the prompt came with the pages)
            self.hidden.set_pending_bytes(req, raw[RECORD_BYTES:])  # the record's tail (AuxRecord.hidden)
        if inb.finish_ahead is not None:
            self.scheduler.finish(req, inb.finish_ahead)
        else:
            self.scheduler.join_decode(req)

    def _kv_load_failed(self, req: Req, inb: Inbound, reason: str) -> None:
        """The room's KV will not arrive: fail the request (502), or compute its prompt here
        (--kv-load-failure-policy recompute) unless its first token ended it already."""
        if self.config.kv_load_failure_policy != "recompute":
            self.scheduler.fail(req, reason)
        elif inb.finish_ahead is not None:
            self.scheduler.finish(req, inb.finish_ahead)
        else:
            self._recompute(req, inb, reason)

    def _recompute(self, req: Req, inb: Inbound, reason: str) -> None:
        log.warning("request %s: %s; computing its prompt here (--kv-load-failure-policy recompute)", req.rid, reason)
        for queue in (self.prealloc, self.transferring):
            if req in queue:
                queue.remove(req)
        husk = Req(f"{req.rid} (failed room)", req.prompt_ids, req.params)  # holds the room's memory
        self.scheduler.memory.hand_over(req, husk)
        del self.inbound[req]
        self.inbound[husk] = inb
        if self.release(husk, FinishReason("abort", message=reason)):  # else quarantined until no write lands
            self.scheduler.free(husk)
        self.kv_manager.counters["rooms_recomputed"] += 1
        req.status, req.decode_hit_len = ReqStatus.WAITING, None
        self.scheduler.queue_for_prefill(req)

    def _valid_record(self, req: Req, raw: bytes) -> AuxRecord | None:
        """The aux record, or None after failing the request (502) when it is unusable."""
        try:
            rec = AuxRecord.unpack(raw, self.hidden.hidden_bytes if self.hidden is not None else 0)
        except ValueError as e:
            problem: str | None = str(e)
        else:
            problem = self._aux_problem(req, rec)
        if problem is not None:
            self.scheduler.fail(req, f"invalid aux record from prefill: {problem}", 502)
            return None
        return rec

    def _poll_quarantined(self, req: Req) -> None:
        inb = self.inbound[req]
        reusable = inb.receiver.pages_reusable()
        if reusable or self.scheduler.clock() > inb.quarantine_deadline:
            if not reusable:
                log.warning(
                    "room %d: no final status from prefill %s within %.0f s; reusing its pages",
                    inb.receiver.room_id,
                    inb.receiver.prefill_endpoint,
                    self.config.transfer_timeout_s,
                )
            self.quarantined.remove(req)
            self._drop_transfer_state(req)
            self.scheduler.free(req)

    def _aux_problem(self, req: Req, rec: AuxRecord) -> str | None:
        """What makes the record unusable, if anything: it must belong to this room and prompt, and
        every token id must index the vocabulary before it reaches the model."""
        room, n = req.rendezvous.room_id, len(req.prompt_ids)
        if rec.room_id != room or rec.prompt_len != n:
            return f"it is for room {rec.room_id} / {rec.prompt_len} tokens, expected {room} / {n}"
        tokens = [rec.first_token] + [t for t, _ in rec.top_logprobs or []]
        if any(not 0 <= t < self.vocab_size for t in tokens):
            return f"token id outside the vocabulary of {self.vocab_size}"
        if not 0 <= rec.cached_tokens <= n:
            return f"cached_tokens {rec.cached_tokens} outside [0, {n}]"
        return None

    def _drop_transfer_state(self, req: Req) -> None:
        inb = self.inbound.pop(req)
        if inb.receiver is not None:
            inb.receiver.release()  # drop the room from the manager's table
        if inb.aux_slot is not None:
            self.aux_pool.free(inb.aux_slot)

    # -- exits ---------------------------------------------------------------------------------
    def release(self, req: Req, reason: FinishReason) -> bool:
        for q in (self.prealloc, self.transferring):
            if req in q:
                q.remove(req)
        inb = self.inbound.get(req)
        if inb is None:
            return True
        if inb.receiver is not None:
            inb.receiver.abort(reason.message or "aborted")  # tells the prefill to stop writing
            if not inb.receiver.pages_reusable():
                inb.quarantine_deadline = self.scheduler.clock() + self.config.transfer_timeout_s
                self.quarantined.append(req)
                return False
        self._drop_transfer_state(req)
        return True

    def memory_returning(self) -> bool:
        """Quarantined rooms free their pages within their bound; rooms whose KV is arriving join the
        running batch within theirs, and then the newest of it can be retracted (its KV cached, on the
        host tier if there is one) to make room."""
        return bool(self.quarantined or self.transferring)

    def requests(self) -> list[Req]:
        return self.prealloc + self.transferring + self.quarantined

    def check_integrity(self) -> None:
        self.aux_pool.check_integrity(sum(1 for inb in self.inbound.values() if inb.aux_slot is not None))
        if set(self.inbound) != {*self.prealloc, *self.transferring, *self.quarantined}:
            raise MemoryIntegrityError("decode transfer state held by a request no queue of the role knows")

    def info(self) -> dict:
        taken = sum(1 for i in self.inbound.values() if i.aux_slot is not None)
        return super().info() | {"aux_slots_free": self.aux_pool.num_slots - taken}

    def queue_depths(self) -> dict[str, int]:
        return {
            "prealloc": len(self.prealloc),
            "transferring": len(self.transferring),
            "quarantined": len(self.quarantined),
        }
