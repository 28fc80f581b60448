"""KVSender -> KVReceiver throughput vs the raw backend call moving the same bytes in one piece,
between two processes, per backend. Prints one table: the median of --repeat rounds, each one room
sent by KVSender then one raw write; ratio = ours / raw.

    .venv/bin/python benchmarks/transfer_bench.py [--backends mooncake nixl] [--device cpu|cuda] [--repeat 5]

Cases: the KV of a 2048-token prompt of the built-in model's shape (30 layers, 3 kv heads, dim 64,
page 16) sent in 4 chunks, with contiguous and with fragmented destination pages; and a large
synthetic pool (256 MiB) in 8 chunks.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PAGE = 16
CASES = {  # name: (layers, heads, head_dim, prompt tokens, chunks, fragmented destination)
    "2k-prompt contiguous": (30, 3, 64, 2048, 4, False),
    "2k-prompt fragmented": (30, 3, 64, 2048, 4, True),
    "256MiB pool": (32, 8, 128, 1024, 8, False),
}


def make_manager(mode: str, backend: str, device: str, layers: int, heads: int, dim: int, pages: int, aux):
    import torch

    from transfer.decode_manager import DecodeKVManager
    from transfer.manager import KVArgs
    from transfer.prefill_manager import PrefillKVManager

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bufs = [torch.ones((pages + 1) * PAGE, heads, dim, dtype=dtype, device=device) for _ in range(2 * layers)]
    bpp = PAGE * heads * dim * bufs[0].element_size()
    args = KVArgs([b.data_ptr() for b in bufs], [b.numel() * b.element_size() for b in bufs], [bpp] * len(bufs), pages, PAGE,
                  backend=backend, on_cuda=device == "cuda", aux_ptr=aux.data_ptr() if aux is not None else 0,
                  aux_record_bytes=64 if aux is not None else 0, aux_slots=1 if aux is not None else 0)
    manager = (PrefillKVManager if mode == "prefill" else DecodeKVManager)(args)
    total = 2 * layers * (pages // (2 if mode == "decode" else 1)) * bpp
    big = torch.ones(total, dtype=torch.uint8, device=device)  # the raw baseline moves this in one piece
    manager.backend.register(big.data_ptr(), total, device == "cuda")
    return manager, bufs, big


def decode_side(backend, device, case, q_out, q_in):
    import torch

    from transfer.poll import KVPoll
    from transfer.receiver import KVReceiver

    layers, heads, dim, tokens, _, frag = CASES[case]
    pages = tokens // PAGE
    aux = torch.zeros(1, 64, dtype=torch.uint8)
    manager, bufs, big = make_manager("decode", backend, device, layers, heads, dim, 2 * pages, aux)
    endpoint, prefill_id, rooms = q_in.get()
    dst = list(range(1, 2 * pages + 1, 2)) if frag else list(range(1, pages + 1))
    q_out.put((big.data_ptr(), manager.instance_id))
    for room in range(rooms):
        r = KVReceiver(manager, room, endpoint, prefill_id)
        r.init(dst, 0)
        while r.poll() not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(0.0005)
        r.release()
    q_in.get()
    os._exit(0)


def send_room(manager, room: int, pages: int, chunks: int) -> float:
    """Seconds from queueing a room's first chunk to its success (the aux record written last)."""
    from transfer.poll import KVPoll
    from transfer.sender import KVSender

    s = KVSender(manager, room)
    while s.poll() != KVPoll.WaitingForInput:
        time.sleep(0.0005)
    per = pages // chunks
    t0 = time.perf_counter()
    for c in range(chunks):
        last = c == chunks - 1
        s.send(list(range(1 + c * per, 1 + (c + 1) * per)), is_last=last, aux=bytes(64) if last else None)
    while s.poll() not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(0.0001)
    elapsed = time.perf_counter() - t0
    if s.poll() != KVPoll.Success:
        raise RuntimeError(f"room {room} failed: {s.failure_reason}")
    s.release()
    return elapsed


def prefill_side(backend, device, case, repeat, q_out, q_in, results):
    layers, heads, dim, tokens, chunks, _ = CASES[case]
    pages = tokens // PAGE
    manager, bufs, big = make_manager("prefill", backend, device, layers, heads, dim, pages, None)
    q_out.put((manager.endpoint, manager.instance_id, repeat + 1))
    dst_base, decode_id = q_in.get()
    total = 2 * layers * pages * manager.args.bytes_per_page[0]
    ours, raw = [], []
    try:
        for room in range(repeat + 1):  # ours and raw alternate, so load from other processes hits both alike
            elapsed = send_room(manager, room, pages, chunks)
            t0 = time.perf_counter()
            manager.backend.write_batch(decode_id, [big.data_ptr()], [dst_base], [total], device == "cuda")
            if room:  # the first round warms up connections
                ours.append(elapsed)
                raw.append(time.perf_counter() - t0)
        results.put((case, total, statistics.median(ours), statistics.median(raw)))
    except Exception as e:
        results.put((case, repr(e)))
    q_out.put("done")
    for q in (results, q_out):  # os._exit skips the queues' feeder threads: flush them first
        q.close()
        q.join_thread()
    os._exit(0)


def run_case(backend: str, device: str, case: str, repeat: int) -> tuple:
    ctx = mp.get_context("spawn")
    to_dec, to_pre, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=decode_side, args=(backend, device, case, to_pre, to_dec)),
             ctx.Process(target=prefill_side, args=(backend, device, case, repeat, to_dec, to_pre, results))]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    if len(out) == 2:
        raise RuntimeError(f"{backend} {case}: {out[1]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="+", default=["mooncake", "nixl"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ns = ap.parse_args()
    if ns.device == "cuda":
        os.environ.setdefault("MC_INTRANODE_NVLINK", "true")
        os.environ.setdefault("UCX_TLS", "cuda_ipc,cuda_copy,tcp")
    rows = []
    for backend in ns.backends:
        for case in ns.cases:
            case_name, total, ours, raw = run_case(backend, ns.device, case, ns.repeat)
            rows.append((backend, case_name, total, total / ours, total / raw))
            print(f"  {backend:9} {case_name:22} done", flush=True)
    print(f"\n{'backend':9} {'case':22} {'MiB':>8} {'ours GB/s':>10} {'raw GB/s':>10} {'ratio':>7}")
    for backend, case, total, ours, raw in rows:
        print(f"{backend:9} {case:22} {total / 2**20:8.1f} {ours / 1e9:10.3f} {raw / 1e9:10.3f} {ours / raw:7.2f}")


if __name__ == "__main__":
    main()
