"""KVSender -> KVReceiver throughput vs raw backend calls moving the same bytes, between two processes,
per backend. Prints one table, medians of --repeat rounds; a round is one room sent by KVSender, one
raw write of the same bytes in one piece, and one raw write of the room's pieces in one call (the
backend's own cost per piece, which no caller can remove). ratio = ours / raw.

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


def send_room(manager, room: int, pages: int, chunks: int) -> tuple[float, list[int]]:
    """Seconds from queueing a room's first chunk to its success (the aux record written last), and
    the destination pages the decode asked for."""
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
    dst_pages = s.room.request.dst_pages
    s.release()
    return elapsed, dst_pages


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def prefill_side(backend, device, case, repeat, q_out, q_in, results):
    from transfer.runs import chunk_triples

    layers, heads, dim, tokens, chunks, _ = CASES[case]
    pages = tokens // PAGE
    manager, bufs, big = make_manager("prefill", backend, device, layers, heads, dim, pages, None)
    q_out.put((manager.endpoint, manager.instance_id, repeat + 1))
    dst_base, decode_id = q_in.get()
    a, write = manager.args, manager.backend.write_batch
    total = 2 * layers * pages * a.bytes_per_page[0]
    times = []  # per round: ours, raw in one piece, raw with the room's pieces
    try:
        for room in range(repeat + 1):  # the three alternate, so load from other processes hits them alike
            elapsed, dst_pages = send_room(manager, room, pages, chunks)
            one = [big.data_ptr()], [dst_base], [total]
            pieces = chunk_triples(a.kv_ptrs, manager.peers[decode_id].kv_ptrs, a.bytes_per_page, range(1, pages + 1), dst_pages)
            row = elapsed, timed(write, decode_id, *one, a.on_cuda), timed(write, decode_id, *pieces, a.on_cuda)
            if room:  # the first round warms up connections
                times.append(row)
        results.put((case, total, len(pieces[0]), *(statistics.median(col) for col in zip(*times))))
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
            rows.append((backend, *run_case(backend, ns.device, case, ns.repeat)))
            print(f"  {backend:9} {case:22} done", flush=True)
    print(f"\n{'backend':9} {'case':22} {'MiB':>6} {'pieces':>6} {'ours GB/s':>9} {'raw GB/s':>8} {'ratio':>5}"
          f" {'raw pieces GB/s':>15} {'ratio':>5}")
    for backend, case, total, pieces, ours, raw, raw_pieces in rows:
        print(f"{backend:9} {case:22} {total / 2**20:6.1f} {pieces:6d} {total / ours / 1e9:9.3f} {total / raw / 1e9:8.3f}"
              f" {raw / ours:5.2f} {total / raw_pieces / 1e9:15.3f} {raw_pieces / ours:5.2f}")


if __name__ == "__main__":
    main()
