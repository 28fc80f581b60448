"""Thousands of fragmented pieces through the real backends between two processes: every destination
page stands alone (the decode's free pages interleave with used ones), the room finishes within a
bound, and every byte lands where it belongs and nowhere else."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from tests.forked import fork_server
from tests.tiers import starts_processes

BUFFERS, PAGES, CHUNKS = 64, 128, 4  # 64 x 128 = 8192 pieces, 2048 per chunk
PAGE_WORDS = 256  # int32 words per page: 1 KiB
AUX_BYTES = 16
BOUND_S = 30.0  # seconds from the decode's request to its success; the data is 8 MiB
MODULES = {"mooncake": "mooncake.engine", "nixl": "nixl._api"}


def pattern(buffer: int, pages: int):
    """A buffer's contents on the prefill: every int32 word in the whole KV differs from every other."""
    import torch

    return (torch.arange((pages + 1) * PAGE_WORDS, dtype=torch.int32) + buffer * 10_000_000).view(pages + 1, PAGE_WORDS)


def make_manager(mode: str, backend: str, pages: int, bufs, aux=None):
    from transfer.decode.decode_manager import DecodeKVManager
    from transfer.manager import KVArgs
    from transfer.prefill.prefill_manager import PrefillKVManager

    args = KVArgs(
        [b.data_ptr() for b in bufs],
        [b.numel() * 4 for b in bufs],
        [PAGE_WORDS * 4] * BUFFERS,
        pages,
        16,
        backend=backend,
        aux_ptr=aux.data_ptr() if aux is not None else 0,
        aux_record_bytes=AUX_BYTES if aux is not None else 0,
        aux_slots=1 if aux is not None else 0,
        kv_wait_timeout_s=BOUND_S,
        transfer_timeout_s=BOUND_S,
    )
    return (PrefillKVManager if mode == "prefill" else DecodeKVManager)(args)


def prefill_proc(backend: str, to_decode: mp.Queue, from_decode: mp.Queue) -> None:
    from tests.unit.test_transfer_protocol import wait_for
    from transfer.poll import KVPoll
    from transfer.prefill.sender import KVSender

    bufs = [pattern(i, PAGES) for i in range(BUFFERS)]
    manager = make_manager("prefill", backend, PAGES, bufs)
    to_decode.put((manager.endpoint, manager.instance_id))
    sender = KVSender(manager, 7)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, timeout=BOUND_S)
    per = PAGES // CHUNKS
    for c in range(CHUNKS):
        last = c == CHUNKS - 1
        sender.send(
            list(range(1 + c * per, 1 + (c + 1) * per)),
            is_last=last,
            aux=bytes(range(1, AUX_BYTES + 1)) if last else None,
        )
    from_decode.get(timeout=2 * BOUND_S)  # keep the memory registered until the decode has checked
    manager.close()


def decode_proc(backend: str, from_prefill: mp.Queue, to_prefill: mp.Queue, results: mp.Queue) -> None:
    import torch

    from transfer.decode.receiver import KVReceiver
    from transfer.poll import KVPoll

    bufs = [torch.zeros(2 * PAGES + 1, PAGE_WORDS, dtype=torch.int32) for _ in range(BUFFERS)]
    aux = torch.zeros(1, AUX_BYTES, dtype=torch.uint8)
    manager = make_manager("decode", backend, 2 * PAGES, bufs, aux)
    endpoint, prefill_id = from_prefill.get(timeout=60)
    receiver = KVReceiver(manager, 7, endpoint, prefill_id)
    t0 = time.monotonic()
    receiver.init(list(range(1, 2 * PAGES, 2)), aux_slot=0)  # pages 1, 3, 5, ...: no two adjacent
    while receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(0.005)
    out = {"state": receiver.poll().name, "reason": receiver.failure_reason, "elapsed_s": time.monotonic() - t0}
    if receiver.poll() == KVPoll.Success:
        out["pages_ok"] = all(torch.equal(b[1::2], pattern(i, PAGES)[1:]) for i, b in enumerate(bufs))
        out["gaps_untouched"] = all(not b[0::2].any() for b in bufs)
        out["aux"] = aux[0].tolist()
    results.put(out)
    to_prefill.put("checked")
    manager.close()


@starts_processes
def run_pair(backend: str) -> dict:
    """A prefill process sends to a decode process; the decode's findings."""
    ctx = fork_server()  # fresh processes, without importing torch again (tests/forked.py)
    p2d, d2p, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=prefill_proc, args=(backend, p2d, d2p)),
        ctx.Process(target=decode_proc, args=(backend, p2d, d2p, results)),
    ]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=BOUND_S + 60)  # + start-up of both processes
    finally:
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_thousands_of_fragmented_pieces_land_exactly_within_the_bound(backend):
    pytest.importorskip(MODULES[backend])
    out = run_pair(backend)
    assert out["state"] == "Success", out
    assert out["elapsed_s"] < BOUND_S
    assert out["pages_ok"] is True and out["gaps_untouched"] is True
    assert out["aux"] == list(range(1, AUX_BYTES + 1))
