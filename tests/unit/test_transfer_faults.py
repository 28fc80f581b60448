"""The transfer layer's bounds and guards (loopback backend, real ZMQ on 127.0.0.1): a full transfer
queue, a transfer thread that dies, duplicate rooms, replayed and misattributed frames, a decode whose
registered layout differs, and the write fence of a prefill that was frozen."""

from __future__ import annotations

import time

import pytest

from tests.unit.test_transfer_protocol import AUX_BYTES, Side, block_writes_to, start_room, wait_for
from transfer.decode.receiver import KVReceiver
from transfer.messages import ReplayGuard, RoomRequest, Status, encode, open_frame
from transfer.poll import DuplicateRoom, KVPoll
from transfer.prefill.sender import KVSender


def test_a_full_transfer_queue_fails_the_room_instead_of_blocking():
    prefill, dec = Side("prefill"), Side("decode")
    prefill.manager.args.max_queued_chunks = 1
    entered, release = block_writes_to(prefill, dec.manager.instance_id)
    s1, _ = start_room(prefill, dec, 60, [1])
    s2, _ = start_room(prefill, dec, 61, [2])
    s3, r3 = start_room(prefill, dec, 62, [3])
    s1.send([1], is_last=True, aux=bytes(AUX_BYTES))
    assert entered.wait(5)  # the worker is busy with room 60
    s2.send([2], is_last=True, aux=bytes(AUX_BYTES))  # waits in the queue: 1 chunk, the bound
    t0 = time.monotonic()
    s3.send([3], is_last=True, aux=bytes(AUX_BYTES))
    assert time.monotonic() - t0 < 0.5 and s3.poll() == KVPoll.Failed
    assert "1 chunks already wait" in s3.failure_reason
    release.set()
    wait_for(lambda: s1.poll() == KVPoll.Success and s2.poll() == KVPoll.Success)
    wait_for(lambda: r3.poll() == KVPoll.Failed and r3.writes_settled)


class Fatal(BaseException):
    """Escapes `except Exception`: what kills a thread."""


def test_a_transfer_thread_that_dies_fails_its_rooms_and_is_replaced():
    prefill, dec = Side("prefill"), Side("decode")
    real = prefill.manager.backend.write_batch
    calls = []

    def write_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise Fatal("segfault-like failure inside the engine binding")
        return real(*args, **kwargs)

    prefill.manager.backend.write_batch = write_batch
    s1, r1 = start_room(prefill, dec, 70, [1])
    s1.send([1], is_last=True, aux=bytes(AUX_BYTES))
    wait_for(lambda: r1.poll() == KVPoll.Failed and r1.writes_settled)
    assert "transfer thread" in r1.failure_reason and "died" in r1.failure_reason
    s2, r2 = start_room(prefill, dec, 71, [2])
    s2.send([2], is_last=True, aux=bytes(range(AUX_BYTES)))
    wait_for(lambda: r2.poll() == KVPoll.Success)
    assert dec.aux[0].tolist() == list(range(AUX_BYTES))


def test_a_room_id_held_by_another_request_is_refused_on_both_sides():
    prefill, dec = Side("prefill"), Side("decode")
    sender = KVSender(prefill.manager, 80)
    with pytest.raises(DuplicateRoom, match="bootstrap_room 80 is already in use on this prefill"):
        KVSender(prefill.manager, 80)
    receiver = KVReceiver(dec.manager, 80, prefill.manager.endpoint, prefill.manager.instance_id)
    with pytest.raises(DuplicateRoom, match="bootstrap_room 80 is already in use on this decode"):
        KVReceiver(dec.manager, 80, prefill.manager.endpoint, prefill.manager.instance_id)
    sender.abort("done")
    sender.release()
    with pytest.raises(DuplicateRoom):  # its tombstone keeps the id taken while a late decode may ask
        KVSender(prefill.manager, 80)
    receiver.release()


def test_replayed_and_stale_frames_are_rejected():
    guard = ReplayGuard(window_s=300.0)
    frame = encode(Status(1, True, ""), "s", sender="prefill-a", seq=10)
    _, envelope = open_frame(frame, "s")
    guard.check(envelope)
    with pytest.raises(ValueError, match="replayed"):
        guard.check(open_frame(frame, "s")[1])
    with pytest.raises(ValueError, match="replayed"):
        guard.check(open_frame(encode(Status(1, True, ""), "s", sender="prefill-a", seq=9), "s")[1])
    stale = ReplayGuard(window_s=300.0, clock=lambda: time.time() + 3600)
    with pytest.raises(ValueError, match="clocks out of sync"):
        stale.check(open_frame(encode(Status(1, True, ""), "s", sender="prefill-b", seq=1), "s")[1])


def test_a_replayed_frame_reaches_the_manager_once():
    dec = Side("decode")
    frame = encode(Status(12345, True, ""), None, sender="somebody", seq=5)
    dec.manager.on_frame(frame)
    dec.manager.on_frame(frame)
    assert dec.manager.counters["rejected_messages"] == 2  # unknown room, then replay


def test_a_status_is_accepted_only_from_the_prefill_that_owns_the_room():
    prefill, dec = Side("prefill"), Side("decode")
    _, receiver = start_room(prefill, dec, 90, [1])
    dec.manager.on_frame(encode(Status(90, True, ""), None, sender="an-impostor", seq=1))
    assert dec.manager.counters["rejected_messages"] == 1 and receiver.poll() == KVPoll.WaitingForInput
    assert not receiver.writes_settled


def test_a_decode_whose_layout_differs_is_refused_and_told_why():
    prefill, dec = Side("prefill"), Side("decode")
    dec.manager.args.bytes_per_page = [b * 2 for b in dec.manager.args.bytes_per_page]
    receiver = KVReceiver(dec.manager, 95, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([1], aux_slot=0)
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert "bytes_per_page" in receiver.failure_reason and receiver.writes_settled
    assert prefill.manager.counters["peers_refused"] == 1
    assert dec.manager.instance_id not in prefill.manager.registrations


def test_a_prefill_does_not_write_into_a_decode_whose_pings_are_stale():
    prefill, dec = Side("prefill", heartbeat_s=0.3), Side("decode", heartbeat_s=0.3)
    sender, receiver = start_room(prefill, dec, 96, [1])
    prefill.manager.liveness.wall_clock = lambda: time.time() + 5  # as if this process slept 5 s
    sender.send([2], is_last=True, aux=bytes(AUX_BYTES))
    wait_for(lambda: sender.poll() == KVPoll.Failed)
    assert "not writing" in sender.failure_reason and "sent nothing for" in sender.failure_reason
    assert dec.page(0, 1).abs().sum() == 0  # nothing landed
    wait_for(lambda: receiver.writes_settled)


def test_a_dead_prefills_pages_are_reusable_one_interval_after_it_was_declared_dead():
    prefill, dec = Side("prefill"), Side("decode", heartbeat_s=0.2)
    _, receiver = start_room(prefill, dec, 97, [1])
    prefill.manager.close()  # silent from now on, as if killed
    wait_for(lambda: receiver.poll() == KVPoll.Failed, timeout=5)
    declared = time.monotonic()
    assert "answered no heartbeat" in receiver.failure_reason and not receiver.writes_settled
    assert not receiver.pages_reusable()
    wait_for(lambda: receiver.pages_reusable(), timeout=5)
    assert 0.2 + 1.0 - 0.15 < time.monotonic() - declared < 0.2 + 1.0 + 0.5  # one interval + the clock slack


def test_a_decode_request_from_an_unregistered_decode_names_it():
    prefill = Side("prefill")
    prefill.manager.on_frame(encode(RoomRequest(5, "stranger", [1], 0), None))
    assert prefill.manager.counters["rejected_messages"] == 1


def test_a_decode_abort_of_a_room_the_prefill_failed_and_forgot_waits_for_the_write_in_flight():
    """The prefill request ended (room failed, forgotten, tombstoned) while a write of it still runs; the
    decode's abort arrives then: its status must still come after that write, not at once."""
    prefill, dec = Side("prefill"), Side("decode")
    entered, release = block_writes_to(prefill, dec.manager.instance_id)
    sender, receiver = start_room(prefill, dec, 23, [1, 2])
    sender.send([1], is_last=False, aux=None)
    assert entered.wait(5)
    sender.abort("prefill request aborted")
    sender.release()
    receiver.abort("the router cancelled the decode half")
    time.sleep(0.3)
    assert not receiver.writes_settled  # the write may still land: the pages are not reusable yet
    release.set()
    wait_for(lambda: receiver.writes_settled)


def test_a_decode_that_registers_again_has_given_up_on_its_rooms_there():
    """A decode registers again only after it declared this prefill dead (it will reuse those rooms' pages):
    the prefill fails them at once, so a prefill that was frozen writes nothing more into them, although
    the decode's new frames make its write fence fresh again. Its socket to the decode is replaced: after a
    partition the old TCP connection may sit in retransmission backoff for seconds."""
    prefill, dec = Side("prefill"), Side("decode")
    sender, _ = start_room(prefill, dec, 98, [1])
    dropped, drop = [], prefill.manager.control.drop
    prefill.manager.control.drop = lambda endpoint: (dropped.append(endpoint), drop(endpoint))
    dec.manager.registered_with.pop(prefill.manager.endpoint)  # as declare_dead does
    later = KVReceiver(dec.manager, 99, prefill.manager.endpoint, prefill.manager.instance_id)
    later.init([2], aux_slot=1)  # a new room: a new register first, then its request
    wait_for(lambda: sender.poll() == KVPoll.Failed)
    assert "registered again" in sender.failure_reason
    assert dropped == [dec.manager.endpoint]
    sender.send([3], is_last=True, aux=bytes(AUX_BYTES))  # the old room's KV, computed late
    time.sleep(0.2)
    assert dec.page(0, 1).abs().sum() == 0


def test_a_room_that_failed_before_it_was_requested_is_never_requested():
    """A request waiting for decode memory when its prefill is declared dead: its room fails, and it is not
    requested later (which would open the prefill's fence and free its pages on a stale timer)."""
    prefill, dec = Side("prefill"), Side("decode", heartbeat_s=0.2)
    _, first = start_room(prefill, dec, 60, [1])
    waiting = KVReceiver(dec.manager, 61, prefill.manager.endpoint, prefill.manager.instance_id)
    prefill.manager.close()
    wait_for(lambda: first.poll() == KVPoll.Failed, timeout=5)
    assert waiting.poll() == KVPoll.Failed and waiting.room.prefill_dead_at is None
    assert waiting.init([2], aux_slot=1) is False
    assert not waiting.room.requested and waiting.pages_reusable()


def test_a_prefill_restarted_at_the_same_endpoint_is_registered_with_again():
    """Registration is per prefill instance, not per endpoint: a new process that got the old one's
    address hears where this decode's buffers are before its first room request."""
    dec = Side("decode")
    sent: list[object] = []
    dec.manager.send = lambda endpoint, msg: sent.append(msg)
    for prefill_id in ("prefill-a", "prefill-a", "prefill-b"):
        dec.manager.register_with("tcp://127.0.0.1:5555", prefill_id)
    assert [type(m).__name__ for m in sent] == ["Register", "Register"]
