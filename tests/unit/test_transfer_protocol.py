"""The transfer layer without a model: run grouping, triples, KVPoll, message validation, and a full
prefill -> decode room over the loopback backend with exact bytes."""
from __future__ import annotations

import time

import msgpack
import pytest
import torch

from transfer.manager import KVArgs, KVManager
from transfer.messages import BadMessage, Register, Request, Status, decode, encode
from transfer.poll import KVPoll, PollState
from transfer.receiver import KVReceiver
from transfer.runs import chunk_triples, group_contiguous_runs
from transfer.sender import KVSender

PAGE, LAYERS, PAGES = 4, 2, 16
AUX_BYTES = 32


def test_runs_group_pages_contiguous_on_both_sides():
    assert group_contiguous_runs([1, 2, 3, 7, 8], [10, 11, 12, 13, 20]) == [(1, 10, 3), (7, 13, 1), (8, 20, 1)]
    assert group_contiguous_runs([], []) == []
    with pytest.raises(ValueError):
        group_contiguous_runs([1], [1, 2])


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
    [b"\x00garbage", msgpack.packb({"type": "request", "room": 1}), msgpack.packb({"type": "nope"}),
     msgpack.packb([1, 2]), encode(Request(1, "d", [1, "x"], 0), None)[:-3]],
)
def test_garbage_and_truncated_messages_are_rejected(raw):
    with pytest.raises(BadMessage):
        decode(raw, None)


def test_wrong_secret_is_rejected_and_right_secret_accepted():
    msg = Status(5, True, "")
    with pytest.raises(BadMessage, match="secret"):
        decode(encode(msg, "wrong"), "right")
    with pytest.raises(BadMessage, match="secret"):
        decode(encode(msg, None), "right")
    assert decode(encode(msg, "right"), "right") == msg


def test_wrong_field_types_are_rejected():
    raw = msgpack.packb({"type": "status", "secret": None, "room": "5", "ok": True, "reason": ""})
    with pytest.raises(BadMessage, match="room"):
        decode(raw, None)


class Side:
    """A fake pool (torch buffers) plus a manager, on 127.0.0.1 with the loopback backend."""

    def __init__(self, mode: str, secret: str | None = None, backend: str = "loopback", timeout: float = 2.0):
        self.k = [torch.zeros((PAGES + 1) * PAGE, 8, dtype=torch.float32) for _ in range(2 * LAYERS)]
        self.aux = torch.zeros(4, AUX_BYTES, dtype=torch.uint8)
        bpp = PAGE * 8 * 4
        self.args = KVArgs([b.data_ptr() for b in self.k], [b.numel() * 4 for b in self.k], [bpp] * len(self.k),
                           PAGES, PAGE, backend=backend, secret=secret, aux_ptr=self.aux.data_ptr(),
                           aux_record_bytes=AUX_BYTES, aux_slots=4, kv_wait_timeout_s=timeout)
        self.manager = KVManager(self.args, mode)

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
    assert sender.poll() == KVPoll.Bootstrapping
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
    assert prefill.manager.rooms.get(5) is None or prefill.manager.rooms[5].request is None


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


def test_register_validation_rejects_bad_pointers():
    bad = Register("d", "tcp://x:1", b"a", [0], [16], 4, 4, 1, 8, 1)
    with pytest.raises(BadMessage):
        decode(encode(bad, None), None)
