"""Decode role: find the request's prefill peer, pre-allocate a row, KV pages for the whole prompt and
an aux slot, tell prefill where to write, wait for Success, commit the first token from the aux
record and join the decode batch with no prefill forward.

    prealloc queue --(row + pages + aux slot reserved, receiver.init)--> transfer queue --(Success)--> running
       nothing held                                                    row + prompt KV + aux slot

Who frees what: a failed or aborted transfer leaves garbage in its pages, so it is released with
cache=False (pages straight back to the allocator, never into the radix cache); the aux slot is
returned here when the request leaves the transfer queue.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from common.aux_record import AuxRecord
from common.request import FinishReason, Req, ReqStatus
from common.scheduler import Scheduler
from decode_node.aux_pool import AuxPool
from decode_node.peers import PeerDirectory
from transfer.poll import KVPoll

log = logging.getLogger(__name__)


class DecodeScheduler(Scheduler):
    def __init__(self, *args, kv_manager, aux_pool: AuxPool, peers: PeerDirectory, **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_manager = kv_manager
        self.aux_pool = aux_pool
        self.peers = peers
        self.lookups = ThreadPoolExecutor(max_workers=4, thread_name_prefix="peer-lookup")
        self.prealloc: list[tuple[Req, Future]] = []
        self.transferring: list[Req] = []
        self.receivers: dict[str, object] = {}
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

    def _poll_prealloc(self) -> None:
        now = time.monotonic()
        for req, lookup in list(self.prealloc):
            if now - req.arrival_time > self.config.bootstrap_timeout_s:
                self._fail(req, f"could not reserve memory or reach the prefill peer within {self.config.bootstrap_timeout_s:.0f} s", 504)
            elif lookup.done():
                if lookup.exception() is not None:
                    self._fail(req, f"prefill peer lookup failed: {lookup.exception()}")
                elif not self._try_prealloc(req, lookup.result()):
                    break  # FIFO: wait for memory before reserving for later requests

    def _try_prealloc(self, req: Req, peer) -> bool:
        n = len(req.prompt_ids)
        busy = len(self.running) + len(self.transferring)
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
        from transfer.receiver import KVReceiver

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

    def _commit_first_token(self, req: Req) -> None:
        rec = AuxRecord.unpack(self.aux_pool.read(self.aux_slots[req.rid]))
        room = req.bootstrap["bootstrap_room"]
        if rec.room != room or rec.prompt_len != len(req.prompt_ids):
            self._fail(req, f"aux record is for room {rec.room} / {rec.prompt_len} tokens, expected {room} / {len(req.prompt_ids)}", 500)
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
        in_transfer = req in self.transferring
        receiver = self.receivers.get(req.rid)
        if receiver is not None and reason.type == "abort" and receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
            receiver.abort(reason.message or "aborted")
        self.prealloc = [(r, f) for r, f in self.prealloc if r is not req]
        if in_transfer:
            self.transferring.remove(req)
            self.kv.release(req, cache=False)  # the pages may hold a partial transfer
        self._drop_transfer_state(req)
        super().finish(req, reason)

    def role_has_work(self) -> bool:
        return bool(self.prealloc or self.transferring)

    def role_requests(self) -> list[Req]:
        return [r for r, _ in self.prealloc] + self.transferring

    def num_held_elsewhere(self) -> int:
        return len(self.transferring)
