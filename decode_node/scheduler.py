"""Decode role: find the request's prefill peer, pre-allocate a row, KV pages for the whole prompt and
an aux slot, tell prefill where to write, wait for Success, commit the first token from the aux
record and join the decode batch with no prefill forward.

    prealloc queue --(row + pages + aux slot reserved, receiver.init)--> transfer queue --(Success)--> running
       nothing held                                                    row + prompt KV + aux slot
                                                                              |
                                                     (failed / aborted before the prefill's status)
                                                                              v
                                                  draining: the client already has its error; row, pages
                                                  and aux slot wait for the prefill's status (sent after
                                                  its last write) or transfer_timeout_s, then are freed

Who frees what: a failed or aborted transfer leaves garbage in its pages, so it is released with
cache=False (pages straight back to the allocator, never into the radix cache), but only once no
write of the prefill can still land in them; the aux slot is returned with the pages.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from common.engine.request import FinishReason, Req, ReqStatus
from common.engine.scheduler import Scheduler
from decode_node.aux_pool import AuxPool
from decode_node.peers import Peer, PeerDirectory
from transfer.aux_record import AuxRecord
from transfer.decode_manager import DecodeKVManager
from transfer.poll import KVPoll
from transfer.receiver import KVReceiver

log = logging.getLogger(__name__)


class DecodeScheduler(Scheduler):
    def __init__(self, *args, kv_manager: DecodeKVManager, aux_pool: AuxPool, peers: PeerDirectory, vocab_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_manager = kv_manager
        self.aux_pool = aux_pool
        self.peers = peers
        self.vocab_size = vocab_size
        self.lookups = ThreadPoolExecutor(max_workers=4, thread_name_prefix="peer-lookup")
        self.prealloc: list[tuple[Req, Future]] = []
        self.transferring: list[Req] = []
        self.draining: list[tuple[Req, float]] = []  # finished requests whose pages wait, and until when
        self.receivers: dict[str, KVReceiver] = {}
        self.aux_slots: dict[str, int] = {}

    def add_request(self, req: Req) -> None:
        self.output.prepare(req)
        if req.bootstrap is None:
            self.finish(req, FinishReason("abort", message="a decode server needs bootstrap_host/port/room: send requests through the router", status=400))
            return
        req.status = ReqStatus.BOOTSTRAPPING
        b = req.bootstrap
        self.prealloc.append((req, self.lookups.submit(self.peers.lookup, b["bootstrap_host"], b["bootstrap_port"])))

    # -- queues --------------------------------------------------------------------------------
    def poll_role_queues(self) -> None:
        self._poll_prealloc()
        self._poll_transfers()
        self._poll_drains()

    def _poll_prealloc(self) -> None:
        now = time.monotonic()
        for req, lookup in list(self.prealloc):
            if now - req.arrival_time > self.config.bootstrap_timeout_s:
                self._fail(req, f"could not reserve memory or reach the prefill peer within {self.config.bootstrap_timeout_s:g} s", 504)
            elif lookup.done():
                if lookup.exception() is not None:
                    self._fail(req, f"prefill peer lookup failed: {lookup.exception()}")
                elif not self._try_prealloc(req, lookup.result()):
                    break  # FIFO: wait for memory before reserving for later requests

    def _try_prealloc(self, req: Req, peer: Peer) -> bool:
        n = len(req.prompt_ids)
        busy = len(self.running) + self.num_held_elsewhere()
        if busy >= self.config.max_running_requests or not self.kv.can_admit() or not self.aux_pool.can_alloc():
            return False
        self.kv.admit(req, 0)
        reserve = min(req.params.max_new_tokens, 16)
        if not self.kv.can_extend(req, n + reserve):
            self.kv.release(req, cache=False)
            return False
        slots = self.kv.extend(req, n)
        pages = (slots[:: self.config.page_size] // self.config.page_size).tolist()
        aux_slot = self.aux_pool.alloc()
        self.aux_slots[req.rid] = aux_slot
        receiver = KVReceiver(self.kv_manager, req.bootstrap["bootstrap_room"], peer.endpoint, peer.instance_id)
        receiver.init(pages, aux_slot)
        self.receivers[req.rid] = receiver
        self.prealloc = [(r, f) for r, f in self.prealloc if r is not req]
        req.status = ReqStatus.TRANSFERRING
        self.transferring.append(req)
        return True

    def _poll_transfers(self) -> None:
        for req in list(self.transferring):
            receiver = self.receivers[req.rid]
            state = receiver.poll()
            if state == KVPoll.Success:
                self._commit_first_token(req)
            elif state == KVPoll.Failed:
                self._fail(req, f"KV transfer failed: {receiver.failure_reason}")

    def _poll_drains(self) -> None:
        now = time.monotonic()
        for item in list(self.draining):
            req, deadline = item
            receiver = self.receivers[req.rid]
            if receiver.writes_settled or now > deadline:
                if not receiver.writes_settled:
                    log.warning("room %d: no final status from prefill %s within %.0f s; reusing its pages",
                                receiver.room_id, receiver.endpoint, self.config.transfer_timeout_s)
                self.draining.remove(item)
                self.kv.release(req, cache=False)
                self._drop_transfer_state(req)

    def _commit_first_token(self, req: Req) -> None:
        rec = AuxRecord.unpack(self.aux_pool.read(self.aux_slots[req.rid]))
        problem = self._aux_problem(req, rec)
        if problem is not None:
            self._fail(req, f"invalid aux record from prefill: {problem}", 502)
            return
        self.transferring.remove(req)
        self._drop_transfer_state(req)
        req.prefix_hit_len = rec.cached_tokens
        finish = self.output.commit_token(req, rec.first_token, rec.logprob, rec.top_logprobs)
        if finish is not None:
            self.finish(req, finish)
        else:
            req.status = ReqStatus.RUNNING
            self.running.append(req)

    def _aux_problem(self, req: Req, rec: AuxRecord) -> str | None:
        """What makes the record unusable, if anything: it must belong to this room and prompt, and
        every token id must index the vocabulary before it reaches the model."""
        room, n = req.bootstrap["bootstrap_room"], len(req.prompt_ids)
        if rec.room != room or rec.prompt_len != n:
            return f"it is for room {rec.room} / {rec.prompt_len} tokens, expected {room} / {n}"
        tokens = [rec.first_token] + [t for t, _ in rec.top_logprobs or []]
        if any(not 0 <= t < self.vocab_size for t in tokens):
            return f"token id outside the vocabulary of {self.vocab_size}"
        if not 0 <= rec.cached_tokens <= n:
            return f"cached_tokens {rec.cached_tokens} outside [0, {n}]"
        return None

    def _drop_transfer_state(self, req: Req) -> None:
        receiver = self.receivers.pop(req.rid, None)
        if receiver is not None:
            receiver.release()  # drop the room from the manager's table
        slot = self.aux_slots.pop(req.rid, None)
        if slot is not None:
            self.aux_pool.free(slot)

    # -- exits ---------------------------------------------------------------------------------
    def _fail(self, req: Req, message: str, status: int = 502) -> None:
        log.warning("request %s failed: %s", req.rid, message)
        self.finish(req, FinishReason("abort", message=message, status=status))

    def finish(self, req: Req, reason: FinishReason) -> None:
        self.prealloc = [(r, f) for r, f in self.prealloc if r is not req]
        if req in self.transferring:
            self.transferring.remove(req)
            receiver = self.receivers[req.rid]
            receiver.abort(reason.message or "aborted")  # tells the prefill to stop writing
            if not receiver.writes_settled:
                self._drain(req, reason)
                return
            self.kv.release(req, cache=False)  # the pages may hold a partial transfer
        self._drop_transfer_state(req)
        super().finish(req, reason)

    def _drain(self, req: Req, reason: FinishReason) -> None:
        """End the request for the client now; keep its pages until the prefill's writes settle."""
        req.status = ReqStatus.FINISHED
        self.output.finish(req, reason)
        self.draining.append((req, time.monotonic() + self.config.transfer_timeout_s))

    def role_has_work(self) -> bool:
        return bool(self.prealloc or self.transferring or self.draining)

    def role_requests(self) -> list[Req]:
        return [r for r, _ in self.prealloc] + self.transferring

    def num_held_elsewhere(self) -> int:
        return len(self.transferring) + len(self.draining)

    def tracked_requests(self) -> list[Req]:
        return super().tracked_requests() + [r for r, _ in self.draining]

    def check_integrity(self):
        counts = super().check_integrity()
        self.aux_pool.check_integrity(len(self.aux_slots))
        return counts

    def role_info(self) -> dict:
        return {"instance_id": self.kv_manager.instance_id, "control_endpoint": self.kv_manager.endpoint,
                "prealloc": len(self.prealloc), "transferring": len(self.transferring), "draining": len(self.draining),
                "aux_slots_free": self.aux_pool.num_slots - len(self.aux_slots)}
