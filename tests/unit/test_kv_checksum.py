"""KV checksums (transfer/checksum.py) over the loopback backend and real ZMQ: a room whose pages land
intact succeeds; one with a flipped byte anywhere, or with a write dropped, fails naming the mismatch, every
time (a fault-injecting transport: tests/integration/kv_faults.py), and counts; a prefill that sends no
checksums to a decode that wants them fails the room naming the flag."""

from __future__ import annotations

import random

import pytest
import torch

from tests.integration.kv_faults import inject, planned
from tests.unit.test_transfer_protocol import AUX_BYTES, PAGES, Side, start_room, wait_for
from transfer import checksum
from transfer.checksum import mismatch, page_run_sums
from transfer.messages import BadMessage, Status, decode, encode
from transfer.poll import KVPoll


def sides(prefill_sums: bool = True) -> tuple[Side, Side]:
    prefill, dec = Side("prefill"), Side("decode")
    prefill.manager.args.kv_checksum = prefill_sums
    dec.manager.args.kv_checksum = True
    for i, buf in enumerate(prefill.k):
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(i)))
    return prefill, dec


def send_room(prefill: Side, dec: Side, room: int, src: list[int], dst: list[int], chunks: int = 2):
    sender, receiver = start_room(prefill, dec, room, dst)
    cut = len(src) // 2 if chunks == 2 else 0
    if cut:
        sender.send(src[:cut], is_last=False, aux=None)
    sender.send(src[cut:], is_last=True, aux=bytes(AUX_BYTES))
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
    return receiver


def checksum_failures(side: Side) -> float:
    return side.manager.metrics.failures.labels("checksum")._value.get()


def test_an_intact_room_passes_and_its_pages_are_exact():
    prefill, dec = sides()
    receiver = send_room(prefill, dec, 1, [1, 2, 3, 7], [5, 6, 9, 10])
    assert receiver.poll() == KVPoll.Success
    for buf in range(len(dec.k)):
        for s, d in ((1, 5), (2, 6), (3, 9), (7, 10)):
            assert torch.equal(dec.page(buf, d), prefill.page(buf, s))


@pytest.mark.parametrize("fault", ["flip", "drop"])
def test_a_flipped_byte_or_a_dropped_write_is_caught_every_time(fault):
    prefill, dec = sides()
    rng = random.Random(7)
    rooms = 25
    log = inject(
        prefill.manager.backend, planned({i + 1: fault for i in range(rooms)}), kv_only=lambda n: n > AUX_BYTES
    )
    for room in range(rooms):  # one batch each: its pages and aux record; the byte and the runs vary
        src, dst = rng.sample(range(1, PAGES + 1), 4), sorted(rng.sample(range(1, PAGES + 1), 4))
        receiver = send_room(prefill, dec, 100 + room, src, dst, chunks=1)
        assert receiver.poll() == KVPoll.Failed, (room, log)
        assert "checksum mismatch" in receiver.failure_reason and receiver.writes_settled
    assert len(log) == rooms and checksum_failures(dec) == rooms


def test_a_decode_that_wants_checksums_refuses_a_room_without_them():
    prefill, dec = sides(prefill_sums=False)
    receiver = send_room(prefill, dec, 3, [1, 2], [3, 4])
    assert receiver.poll() == KVPoll.Failed and "--disaggregation-enable-kv-checksum" in receiver.failure_reason


def test_checksums_must_cover_every_page_of_the_room():
    buf = torch.arange(64, dtype=torch.uint8)
    ptrs, bpp = [buf.data_ptr()], [8]
    sums = page_run_sums(ptrs, bpp, [1, 2, 5], [1, 2, 5])
    assert [s[:3] for s in sums] == [[0, 1, 2], [0, 5, 1]]
    assert mismatch(ptrs, bpp, [1, 2, 5], sums) is None
    assert "cover 2 of the room's 3 pages" in mismatch(ptrs, bpp, [1, 2, 5], sums[:1])
    buf[41] += 1
    assert "mismatch in 1 of 2 page runs (buffer 0 pages 5-5)" in mismatch(ptrs, bpp, [1, 2, 5], sums)


def test_a_long_run_is_hashed_in_pieces_and_a_flip_names_its_piece(monkeypatch):
    monkeypatch.setattr(checksum, "PIECE_BYTES", 16)  # two 8-byte pages a piece
    buf = torch.arange(80, dtype=torch.uint8)
    ptrs, bpp, pages = [buf.data_ptr()], [8], [1, 2, 3, 4, 5, 7]
    sums = page_run_sums(ptrs, bpp, pages, pages)
    assert [s[:3] for s in sums] == [[0, 1, 2], [0, 3, 2], [0, 5, 1], [0, 7, 1]]
    assert mismatch(ptrs, bpp, pages, sums) is None
    buf[8 * 4 + 3] ^= 0xFF  # page 4: the second piece
    assert "mismatch in 1 of 4 page runs (buffer 0 pages 3-4)" in mismatch(ptrs, bpp, pages, sums)


def test_a_status_carries_well_formed_checksums_only():
    ok = Status(1, True, "", [[0, 3, 2, 2**64 - 1]])
    assert decode(encode(ok, None), None) == ok
    for bad in ([[0, 3, 2]], [[0, 3, 2, -1]], [["0", 3, 2, 1]], [7]):
        with pytest.raises(BadMessage, match="checksums"):
            decode(encode(Status(1, True, "", bad), None), None)
