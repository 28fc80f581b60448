"""KV moved GPU to GPU between two processes by Mooncake and NIXL (UCX cuda_ipc): the decode's device
buffers hold exactly the prefill's bytes, and the write waits for the KV event of the forward that wrote
the pages (here a copy queued behind a long kernel, sent before the device has run it)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tests.unit.test_transfer_protocol import AUX_BYTES, PAGE, Side, wait_for  # noqa: E402

MODULES = {"mooncake": "mooncake.engine", "nixl": "nixl._api"}
SENT = {10: 1, 11: 2, 5: 3, 12: 7, 13: 8}  # decode page <- prefill page
SLOW_KERNEL_CYCLES = 2_000_000_000  # about a second of device time before the pages are written


def pattern(buf: torch.Tensor, i: int) -> torch.Tensor:
    return torch.arange(buf.numel(), dtype=torch.float32, device=buf.device).view_as(buf) * (i + 1) + 0.5


def prefill_proc(backend: str, to_decode: mp.Queue, from_decode: mp.Queue) -> None:
    from common.engine.kv_ready import record_kv_ready
    from transfer.poll import KVPoll
    from transfer.prefill.sender import KVSender

    side = Side("prefill", backend=backend, timeout=30.0, device="cuda")
    to_decode.put((side.manager.endpoint, side.manager.instance_id))
    sender = KVSender(side.manager, 42)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, timeout=30)
    torch.cuda._sleep(SLOW_KERNEL_CYCLES)  # the "forward": the pages are written only after it
    for i, buf in enumerate(side.k):
        buf.copy_(pattern(buf, i))
    ready = record_kv_ready("cuda")  # queued, not reached: the transfer must wait for it
    sender.send([1, 2, 3], is_last=False, aux=None, ready=ready)
    sender.send([7, 8], is_last=True, aux=bytes(range(1, AUX_BYTES + 1)), ready=ready)
    from_decode.get(timeout=90)
    side.manager.close()


def decode_proc(backend: str, from_prefill: mp.Queue, to_prefill: mp.Queue, results: mp.Queue) -> None:
    from transfer.decode.receiver import KVReceiver
    from transfer.poll import KVPoll

    side = Side("decode", backend=backend, timeout=30.0, device="cuda")
    endpoint, prefill_id = from_prefill.get(timeout=60)
    receiver = KVReceiver(side.manager, 42, endpoint, prefill_id)
    receiver.init(list(SENT), aux_slot=3)
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), timeout=60)
    out = {"state": int(receiver.poll()), "reason": receiver.failure_reason, "mismatches": []}
    for i, buf in enumerate(side.k):
        want, got = pattern(buf, i).cpu(), buf.cpu()
        for dst, src in SENT.items():
            if not torch.equal(got[dst * PAGE : (dst + 1) * PAGE], want[src * PAGE : (src + 1) * PAGE]):
                out["mismatches"].append((i, dst))
        untouched = [p for p in range(got.shape[0] // PAGE) if p not in SENT]
        if any(got[p * PAGE : (p + 1) * PAGE].abs().sum() != 0 for p in untouched):
            out["mismatches"].append((i, "a page nobody sent"))
    out["aux"] = side.aux[3].tolist()
    results.put(out)
    to_prefill.put("done")
    side.manager.close()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_gpu_to_gpu_transfer_lands_the_prefills_exact_bytes_after_its_kv_event(backend):
    pytest.importorskip(MODULES[backend])
    ctx = mp.get_context("spawn")
    p2d, d2p, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=prefill_proc, args=(backend, p2d, d2p)),
        ctx.Process(target=decode_proc, args=(backend, p2d, d2p, results)),
    ]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()
    assert out["state"] == 4, out
    assert out["mismatches"] == []
    assert out["aux"] == list(range(1, AUX_BYTES + 1))
