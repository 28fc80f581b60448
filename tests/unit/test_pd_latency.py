"""What keeps the PD path's added latency low, without a model: the scheduler thread sleeps until
something wakes it (no 2 ms polling), control messages and the end of a transfer wake it, and the last
chunk of a room goes out with its aux record in one backend batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

import common.engine.scheduler_thread as scheduler_thread
from common.core.request import Req
from common.engine.role import Role
from common.engine.scheduler_thread import SchedulerThread
from tests.unit.test_scheduler import expected_output, make, req
from tests.unit.test_transfer_protocol import AUX_BYTES, Side, wait_for
from transfer.decode.receiver import KVReceiver
from transfer.poll import KVPoll
from transfer.prefill.sender import KVSender


class PeerRole(Role):
    """Holds one request until `peer_ready` is set (what a PD role does while its peer answers)."""

    def __init__(self, scheduler, held: Req):
        self.scheduler, self.held = scheduler, [held]
        self.peer_ready = threading.Event()
        self.polls = 0

    def admit(self, req: Req) -> bool:
        return True  # held here until the peer is ready

    def poll(self) -> None:
        self.polls += 1
        if self.held and self.peer_ready.is_set():
            self.scheduler.prefill.add(self.held.pop())

    def requests(self) -> list[Req]:
        return list(self.held)


def test_a_waiting_request_does_not_make_the_scheduler_poll_and_a_wake_moves_it_at_once(monkeypatch):
    monkeypatch.setattr(scheduler_thread, "BUSY_POLL_S", 30.0)  # only a wake can move the request in this test
    s, _ = make()
    done = threading.Event()
    held = req("held", [3, 4, 5], max_new=3)
    held.sink = lambda ev: done.set() if ev.finish else None
    s.role = role = PeerRole(s, held)
    thread = SchedulerThread(s, watchdog_timeout_s=60.0)
    s.submit(held)
    thread.start()
    try:
        time.sleep(0.5)
        assert role.polls <= 3  # the submit's step and little else: a 2 ms poll would have made ~250
        t0 = time.monotonic()
        role.peer_ready.set()
        s.wake()  # what a manager's thread does when the peer's message arrives
        assert done.wait(10), "the woken scheduler did not run the request"
        assert time.monotonic() - t0 < 10
    finally:
        thread.stop()
    assert held.output_ids == expected_output([3, 4, 5], 3) and held.finish.type == "length"


def woken(side: Side, once: Callable[[], bool] = lambda: True) -> threading.Event:
    """Set when the side's manager wakes its scheduler while `once()` holds (a frame wakes it after acting on it)."""
    event = threading.Event()
    side.manager.wake_scheduler = lambda: once() and event.set()
    return event


def test_a_room_request_a_transfer_end_and_a_status_each_wake_their_scheduler():
    prefill, dec = Side("prefill"), Side("decode")
    sender = KVSender(prefill.manager, 31)
    receiver = KVReceiver(dec.manager, 31, prefill.manager.endpoint, prefill.manager.instance_id)
    prefill_woken = woken(prefill)
    # the first token comes ahead of the status and wakes the decode too: this waits for the status's wake
    decode_woken = woken(dec, lambda: receiver.room.status_received)
    dec.manager.register_with(
        prefill.manager.endpoint, prefill.manager.instance_id
    )  # its own frame (which wakes too): out of the way first
    wait_for(lambda: dec.manager.instance_id in prefill.manager.registrations)
    prefill_woken.clear()
    receiver.init([2, 3], aux_slot=1)
    assert prefill_woken.wait(5), "the decode's room request did not wake the prefill's scheduler"
    assert sender.poll() == KVPoll.WaitingForInput  # the wake comes after the room was updated
    prefill_woken.clear()
    sender.send([5, 6], is_last=True, aux=bytes(range(AUX_BYTES)))
    assert prefill_woken.wait(5), "the end of the transfer did not wake the prefill's scheduler"
    assert sender.poll() == KVPoll.Success
    assert decode_woken.wait(5), "the prefill's status did not wake the decode's scheduler"
    assert receiver.poll() == KVPoll.Success and receiver.first_record == bytes(range(AUX_BYTES))


def test_the_last_chunk_goes_out_with_its_aux_record_in_one_batch():
    prefill, dec = Side("prefill"), Side("decode")
    for i, buf in enumerate(prefill.k):
        buf.copy_(buf.new_tensor(range(buf.numel())).view_as(buf) + 1000 * i)
    batches: list[list[int]] = []
    real = prefill.manager.backend.write_batch
    prefill.manager.backend.write_batch = lambda peer, src, dst, n, *a: (
        batches.append(dst),
        real(peer, src, dst, n, *a),
    )
    sender = KVSender(prefill.manager, 32)
    receiver = KVReceiver(dec.manager, 32, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([7, 8, 9], aux_slot=2)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.send([1], is_last=False, aux=None)
    wait_for(lambda: len(batches) == 1)  # else the worker merges both chunks into one batch
    sender.send([2, 3], is_last=True, aux=bytes(range(AUX_BYTES)))
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    aux_slot_2 = dec.args.aux_ptr + 2 * AUX_BYTES
    assert len(batches) == 2 and aux_slot_2 not in batches[0] and batches[1][-1] == aux_slot_2
    for buf in range(len(prefill.k)):
        for src, dst in ((1, 7), (2, 8), (3, 9)):
            assert dec.page(buf, dst).tolist() == prefill.page(buf, src).tolist()
    assert dec.aux[2].tolist() == list(range(AUX_BYTES))


@pytest.mark.parametrize(
    "event", ["room_request_received", "chunk_queued", "chunk_written", "aux_written", "status_sent"]
)
def test_the_prefill_side_of_a_room_marks_its_requests_timeline(event):
    prefill, dec = Side("prefill"), Side("decode")
    marks: list[str] = []
    sender = KVSender(prefill.manager, 33, lambda name, at=None: marks.append(name))
    receiver = KVReceiver(dec.manager, 33, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([4], aux_slot=0)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.send([1], is_last=True, aux=bytes(AUX_BYTES))
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    wait_for(lambda: "status_sent" in marks)
    assert marks.count(event) == 1
