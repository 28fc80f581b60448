"""The transfer layer without a model: run grouping, triples, KVPoll, message validation, and a full
prefill -> decode room over the loopback backend with exact bytes."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import torch

from transfer.decode.decode_manager import DecodeKVManager
from transfer.decode.receiver import KVReceiver
from transfer.manager import KVArgs
from transfer.messages import BadMessage, Register, RoomRequest, Status, decode, encode
from transfer.poll import KVPoll, PollState
from transfer.prefill.kv_writer import rank_peer
from transfer.prefill.prefill_manager import PrefillKVManager
from transfer.prefill.runs import chunk_triples
from transfer.prefill.sender import KVSender

PAGE, LAYERS, PAGES = 4, 2, 16
AUX_BYTES = 32


def test_runs_group_pages_contiguous_on_both_sides():
    """One buffer at address 0 with one byte per page: each triple is (src page, dst page, run length)."""
    src, dst, nbytes = chunk_triples([0], [0], [1], [1, 2, 3, 7, 8], [10, 11, 12, 13, 20])
    assert list(zip(src, dst, nbytes)) == [(1, 10, 3), (7, 13, 1), (8, 20, 1)]
    assert chunk_triples([0], [0], [1], [], []) == ([], [], [])
    with pytest.raises(ValueError):
        chunk_triples([0], [0], [1], [1], [1, 2])


def test_chunk_triples_cover_every_buffer_and_run():
    src, dst, n = chunk_triples([1000, 5000], [90000, 99000], [10, 10], [1, 2, 5], [3, 4, 9])
    assert src == [1010, 1050, 5010, 5050]
    assert dst == [90030, 90090, 99030, 99090]
    assert n == [20, 10, 20, 10]


def test_poll_state_only_moves_up_and_failed_wins():
    s = PollState()
    s.advance(KVPoll.Transferring)
    s.advance(KVPoll.WaitingForInput)
    assert s.state == KVPoll.Transferring
    assert s.fail("boom") and s.state == KVPoll.Failed and s.reason == "boom"
    s.advance(KVPoll.Success)
    assert s.state == KVPoll.Failed and not s.fail("again")


@pytest.mark.parametrize(
    "raw",
    [
        b"\x00garbage",
        msgpack.packb({"type": "request", "room_id": 1}),
        msgpack.packb({"type": "nope"}),
        msgpack.packb([1, 2]),
        encode(RoomRequest(1, "d", [1, "x"], 0), None)[:-3],
        msgpack.packb([msgpack.packb({"type": "status", "room_id": 1, "ok": True, "reason": ""}), b""])[:-1],
    ],
)
def test_garbage_and_truncated_messages_are_rejected(raw):
    with pytest.raises(BadMessage):
        decode(raw, None)


def test_a_room_request_carries_the_decodes_cached_prefix_within_range():
    msg = RoomRequest(3, "d", [4, 5], 1, cached_prefix_len=32)
    assert decode(encode(msg, None), None) == msg
    with pytest.raises(BadMessage, match="cached_prefix_len"):
        decode(encode(RoomRequest(3, "d", [4], 1, cached_prefix_len=-16), None), None)


def test_wrong_secret_is_rejected_and_right_secret_accepted():
    msg = Status(5, True, "")
    with pytest.raises(BadMessage, match="secret"):
        decode(encode(msg, "wrong"), "right")
    with pytest.raises(BadMessage, match="secret"):
        decode(encode(msg, None), "right")
    assert decode(encode(msg, "right"), "right") == msg


def test_signed_frames_never_carry_the_secret_and_tampering_is_detected():
    raw = encode(Status(5, True, ""), "s3cret-value")
    assert b"s3cret-value" not in raw
    body, mac = msgpack.unpackb(raw)
    forged = msgpack.packb([body.replace(b"\xc3", b"\xc2"), mac])  # ok: true -> false, same signature
    assert forged != raw
    with pytest.raises(BadMessage, match="secret"):
        decode(forged, "s3cret-value")


def frame(fields: dict) -> bytes:
    return msgpack.packb([msgpack.packb(fields), b""])


def test_wrong_field_types_are_rejected():
    with pytest.raises(BadMessage, match="room"):
        decode(frame({"type": "status", "room_id": "5", "ok": True, "reason": ""}), None)
    with pytest.raises(BadMessage, match="room"):
        decode(frame({"type": "status", "room_id": True, "ok": True, "reason": ""}), None)
    with pytest.raises(BadMessage, match="room out of range"):
        decode(frame({"type": "status", "room_id": -1, "ok": True, "reason": ""}), None)


class Side:
    """A fake pool (torch buffers) plus a manager, on 127.0.0.1 with the loopback backend."""

    def __init__(
        self,
        mode: str,
        secret: str | None = None,
        backend: str = "loopback",
        timeout: float = 2.0,
        heartbeat_s: float = 5.0,
        device: str = "cpu",
    ):
        """`device`: where the KV buffers live (tests/gpu moves them to CUDA); the aux slots stay on the host."""
        self.k = [torch.zeros((PAGES + 1) * PAGE, 8, dtype=torch.float32, device=device) for _ in range(2 * LAYERS)]
        self.aux = torch.zeros(4, AUX_BYTES, dtype=torch.uint8)
        bpp = PAGE * 8 * 4
        self.args = KVArgs(
            [b.data_ptr() for b in self.k],
            [b.numel() * 4 for b in self.k],
            [bpp] * len(self.k),
            PAGES,
            PAGE,
            backend=backend,
            on_cuda=device.startswith("cuda"),
            device_index=self.k[0].device.index or 0,
            secret=secret,
            aux_ptr=self.aux.data_ptr(),
            aux_record_bytes=AUX_BYTES,
            aux_slots=4,
            kv_wait_timeout_s=timeout,
            heartbeat_interval_s=heartbeat_s,
            heartbeat_misses=2,
        )
        self.manager = (PrefillKVManager if mode == "prefill" else DecodeKVManager)(self.args)

    def page(self, buf: int, p: int) -> torch.Tensor:
        return self.k[buf][p * PAGE : (p + 1) * PAGE]


def wait_for(fn, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def test_loopback_room_moves_exact_pages_and_aux():
    prefill, dec = Side("prefill"), Side("decode")
    for i, buf in enumerate(prefill.k):
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view_as(buf) + 1000 * i)
    sender = KVSender(prefill.manager, 77)
    receiver = KVReceiver(dec.manager, 77, prefill.manager.endpoint, prefill.manager.instance_id)
    assert sender.poll() == KVPoll.Pairing
    receiver.init([9, 3, 4], aux_slot=2)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    assert sender.num_dst_pages == 3
    sender.send([1, 2], is_last=False, aux=None)
    sender.send([6], is_last=True, aux=bytes(range(AUX_BYTES)))
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    for buf in range(2 * LAYERS):
        for src, dst in ((1, 9), (2, 3), (6, 4)):
            assert torch.equal(dec.page(buf, dst), prefill.page(buf, src))
        assert dec.page(buf, 1).abs().sum() == 0  # untouched
    assert dec.aux[2].tolist() == list(range(AUX_BYTES)) and dec.aux[1].sum() == 0


def test_out_of_range_pages_are_rejected_counted_and_never_written():
    prefill, dec = Side("prefill"), Side("decode")
    receiver = KVReceiver(dec.manager, 5, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([PAGES + 1], aux_slot=0)
    wait_for(lambda: prefill.manager.counters["rejected_messages"] == 1)
    assert prefill.manager.rooms.get(5) is None or prefill.manager.rooms[5].room_request is None


def test_prefill_abort_reaches_decode_with_the_reason():
    prefill, dec = Side("prefill"), Side("decode")
    sender = KVSender(prefill.manager, 8)
    receiver = KVReceiver(dec.manager, 8, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([1], aux_slot=0)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.abort("prefill out of memory")
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert receiver.failure_reason == "prefill out of memory"


def test_receiver_times_out_when_no_kv_arrives():
    prefill, dec = Side("prefill"), Side("decode")
    receiver = KVReceiver(dec.manager, 9, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([1], aux_slot=0)
    wait_for(lambda: receiver.poll() == KVPoll.Failed, timeout=5)
    assert "within 2 s" in receiver.failure_reason


def test_decode_abort_fails_the_prefill_room():
    prefill, dec = Side("prefill"), Side("decode")
    sender = KVSender(prefill.manager, 10)
    receiver = KVReceiver(dec.manager, 10, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([1], aux_slot=0)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    receiver.abort("client went away")
    wait_for(lambda: sender.poll() == KVPoll.Failed)
    assert "client went away" in sender.failure_reason


def test_unknown_room_status_is_counted():
    dec = Side("decode")
    dec.manager.send(dec.manager.endpoint, Status(12345, True, ""))
    wait_for(lambda: dec.manager.counters["rejected_messages"] == 1)


def test_register_validation_rejects_bad_pointers_and_device_lists():
    bad = Register("d", "tcp://x:1", [b"a"], [0], [16], 4, 4, 1, 8, 1)
    with pytest.raises(BadMessage):
        decode(encode(bad, None), None)
    for devices in ([], [0, 1], [-1], [True]):  # one CUDA device index per rank
        bad = Register("d", "tcp://x:1", [b"a"], [64], [16], 4, 4, 1, 8, 1, device_indices=devices)
        with pytest.raises(BadMessage, match="device_indices"):
            decode(encode(bad, None), None)


def block_writes_to(side: Side, decode_id: str) -> tuple[threading.Event, threading.Event]:
    """Make the prefill's writes to one decode hang until released; returns (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real = side.manager.backend.write_batch

    def write_batch(peer_id, *args, **kwargs):
        if peer_id == rank_peer(decode_id, 0):
            entered.set()
            release.wait(10)
        return real(peer_id, *args, **kwargs)

    side.manager.backend.write_batch = write_batch
    return entered, release


def start_room(prefill: Side, dec: Side, room: int, pages: list[int]) -> tuple[KVSender, KVReceiver]:
    sender = KVSender(prefill.manager, room)
    receiver = KVReceiver(dec.manager, room, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init(pages, aux_slot=0)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    return sender, receiver


def test_decode_abort_is_confirmed_by_the_prefill_so_pages_can_be_reused():
    prefill, dec = Side("prefill"), Side("decode")
    sender, receiver = start_room(prefill, dec, 20, [1, 2])
    assert not receiver.writes_settled
    receiver.abort("client went away")
    wait_for(lambda: receiver.writes_settled)
    assert sender.poll() == KVPoll.Failed and receiver.poll() == KVPoll.Failed


def test_abort_of_a_room_the_prefill_never_started_is_answered_at_once():
    prefill, dec = Side("prefill"), Side("decode")
    receiver = KVReceiver(dec.manager, 21, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([1], aux_slot=0)
    wait_for(lambda: 21 in prefill.manager.rooms)  # the decode's request arrived; no HTTP request yet
    receiver.abort("decode gave up")
    wait_for(lambda: receiver.writes_settled)
    assert 21 not in prefill.manager.rooms


def test_failure_status_never_overtakes_a_write_in_flight():
    prefill, dec = Side("prefill"), Side("decode")
    entered, release = block_writes_to(prefill, dec.manager.instance_id)
    sender, receiver = start_room(prefill, dec, 22, [1, 2])
    sender.send([1], is_last=False, aux=None)
    assert entered.wait(5)
    sender.abort("prefill request aborted")  # while the write is still running
    time.sleep(0.3)
    assert not receiver.writes_settled  # the failure status waits behind the write
    release.set()
    wait_for(lambda: receiver.writes_settled)
    assert receiver.poll() == KVPoll.Failed and receiver.failure_reason == "prefill request aborted"


def test_a_stuck_decode_delays_only_its_own_rooms():
    prefill, stuck, healthy = Side("prefill"), Side("decode"), Side("decode")
    entered, release = block_writes_to(prefill, stuck.manager.instance_id)
    s1, _ = start_room(prefill, stuck, 30, [1])
    s1.send([1], is_last=True, aux=bytes(AUX_BYTES))
    assert entered.wait(5)
    s2, r2 = start_room(prefill, healthy, 31, [2])
    s2.send([3], is_last=True, aux=bytes(range(AUX_BYTES)))
    wait_for(lambda: r2.poll() == KVPoll.Success)
    assert healthy.aux[0].tolist() == list(range(AUX_BYTES))
    release.set()
    wait_for(lambda: s1.poll() == KVPoll.Success)


def test_decode_declares_a_silent_prefill_dead():
    prefill, dec = Side("prefill"), Side("decode", heartbeat_s=0.2)
    _, receiver = start_room(prefill, dec, 40, [1])
    prefill.manager.close()  # stops reading: no more pongs, as if frozen
    t0 = time.monotonic()
    wait_for(lambda: receiver.poll() == KVPoll.Failed, timeout=5)
    assert "answered no heartbeat" in receiver.failure_reason and time.monotonic() - t0 < 2
    assert dec.manager.counters["peers_declared_dead"] == 1
    assert prefill.manager.endpoint not in dec.manager.registered_with


def test_prefill_declares_a_silent_decode_dead():
    prefill, dec = Side("prefill", heartbeat_s=0.2), Side("decode", heartbeat_s=0.2)
    sender, _ = start_room(prefill, dec, 41, [1])
    dec.manager.close()  # no more pings
    wait_for(lambda: sender.poll() == KVPoll.Failed, timeout=5)
    assert "sent no heartbeat" in sender.failure_reason


def test_heartbeats_keep_a_slow_room_alive():
    prefill, dec = Side("prefill", heartbeat_s=0.1), Side("decode", heartbeat_s=0.1)
    sender, receiver = start_room(prefill, dec, 42, [1])
    time.sleep(1.0)  # five heartbeat windows with no KV: both sides still wait
    assert sender.poll() == KVPoll.WaitingForInput and receiver.poll() == KVPoll.WaitingForInput
    sender.send([2], is_last=True, aux=bytes(AUX_BYTES))
    wait_for(lambda: receiver.poll() == KVPoll.Success)


def test_a_late_request_for_a_room_the_prefill_gave_up_on_fails_at_once():
    prefill, dec = Side("prefill"), Side("decode", timeout=60)
    sender = KVSender(prefill.manager, 50)
    sender.abort("no decode reserved memory within 300 s")
    sender.release()
    receiver = KVReceiver(dec.manager, 50, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([1], aux_slot=0)  # decode finally found memory
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert receiver.failure_reason == "no decode reserved memory within 300 s" and receiver.writes_settled
