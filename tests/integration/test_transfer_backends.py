"""Mooncake (TCP) and NIXL (UCX) between two separate processes on 127.0.0.1: exact bytes, aux
record, a prefill abort and a decode timeout; an idle NIXL agent's CPU use."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from tests.forked import fork_server
from tests.tiers import starts_processes
from tests.unit.test_transfer_protocol import AUX_BYTES, PAGE, Side, wait_for

BACKENDS = ["mooncake", "nixl"]
MODULES = {"mooncake": "mooncake.engine", "nixl": "nixl._api"}


def _make(mode: str, backend: str, timeout: float = 30.0) -> Side:
    return Side(mode, backend=backend, timeout=timeout)


def prefill_proc(backend: str, to_decode: mp.Queue, from_decode: mp.Queue, scenario: str) -> None:
    import torch

    from transfer.poll import KVPoll
    from transfer.prefill.sender import KVSender

    side = _make("prefill", backend)
    for i, buf in enumerate(side.k):
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view_as(buf) * (i + 1))
    to_decode.put((side.manager.endpoint, side.manager.instance_id))
    if scenario == "silent":
        from_decode.get(timeout=60)
        return
    sender = KVSender(side.manager, 42)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, timeout=30)
    if scenario == "abort":
        sender.abort("prefill ran out of memory")
    else:
        sender.send([1, 2, 3], is_last=False, aux=None)
        sender.send([7, 8], is_last=True, aux=bytes(range(1, AUX_BYTES + 1)))
    from_decode.get(timeout=60)  # keep the process (and its memory) alive until decode has checked
    side.manager.close()


def decode_proc(backend: str, from_prefill: mp.Queue, to_prefill: mp.Queue, results: mp.Queue, scenario: str) -> None:
    import torch

    from transfer.decode.receiver import KVReceiver
    from transfer.poll import KVPoll

    side = _make("decode", backend, timeout=3.0 if scenario == "silent" else 30.0)
    endpoint, prefill_id = from_prefill.get(timeout=60)
    receiver = KVReceiver(side.manager, 42, endpoint, prefill_id)
    receiver.init([10, 11, 5, 12, 13], aux_slot=3)
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), timeout=30)
    out = {"state": int(receiver.poll()), "reason": receiver.failure_reason}
    if receiver.poll() == KVPoll.Success:
        expected = {10: 1, 11: 2, 5: 3, 12: 7, 13: 8}
        ok = True
        for i, buf in enumerate(side.k):
            want_full = torch.arange(buf.numel(), dtype=torch.float32).view_as(buf) * (i + 1)
            for dst, src in expected.items():
                ok &= torch.equal(buf[dst * PAGE : (dst + 1) * PAGE], want_full[src * PAGE : (src + 1) * PAGE])
            ok &= bool(buf[1 * PAGE : 2 * PAGE].abs().sum() == 0)
        out["bytes_ok"] = ok
        out["aux"] = side.aux[3].tolist()
    results.put(out)
    to_prefill.put("done")
    side.manager.close()


@starts_processes
def run_pair(backend: str, scenario: str) -> dict:
    pytest.importorskip(MODULES[backend])
    ctx = fork_server()  # a fresh process, without importing torch again (tests/forked.py)
    p2d, d2p, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=prefill_proc, args=(backend, p2d, d2p, scenario)),
        ctx.Process(target=decode_proc, args=(backend, p2d, d2p, results, scenario)),
    ]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=90)
    finally:
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_move_exact_pages_and_aux(backend):
    out = run_pair(backend, "ok")
    assert out["state"] == 4, out
    assert out["bytes_ok"] is True
    assert out["aux"] == list(range(1, AUX_BYTES + 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_abort_reaches_the_decode_process(backend):
    out = run_pair(backend, "abort")
    assert out == {"state": 0, "reason": "prefill ran out of memory"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_times_out_when_prefill_never_sends(backend):
    out = run_pair(backend, "silent")
    assert out["state"] == 0 and "no KV arrived within 3 s" in out["reason"]


def idle_agent_cpu(results: mp.Queue) -> None:
    """In a fresh process: the CPU seconds per second an idle NIXL agent uses."""
    import time

    from transfer.backends.nixl import NixlBackend

    backend = NixlBackend()  # idle from here on
    time.sleep(0.5)
    wall, cpu = time.monotonic(), time.process_time()
    time.sleep(2.0)
    results.put((time.process_time() - cpu) / (time.monotonic() - wall))
    results.close()
    results.join_thread()  # sent, before the exit below skips the queue's own flush
    del backend
    os._exit(0)  # a UCX agent can crash at interpreter exit


def test_an_idle_nixl_agent_does_not_spin_a_core():
    pytest.importorskip("nixl._api")
    ctx = fork_server()
    results = ctx.Queue()
    agent = ctx.Process(target=idle_agent_cpu, args=(results,))
    agent.start()
    try:
        assert results.get(timeout=60) < 0.1  # its progress thread used to spin one core
    finally:
        agent.join(10)
