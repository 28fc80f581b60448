"""KVSender -> KVReceiver throughput vs raw backend calls moving the same bytes, between two processes,
per backend. Prints one table, medians of --repeat rounds; a round is one room sent by KVSender, one
raw write of the same bytes in one piece from the prefill's pool into the decode's pool (page-major
only: a layer-major room is no one range; "nan"), and one raw write of the room's pieces in one call
(the backend's own cost per piece, which no caller can remove). ratio = ours / raw. With --kv-checksum both,
rounds with and without checksums alternate in the same two processes, and a last table gives each case's
time per room with them over without.

    .venv/bin/python benchmarks/transfer_bench.py [--backends mooncake nixl] [--device cpu|cuda] [--repeat 5]
        [--layouts page-major layer-major] [--kv-checksum off|on|both]

Layouts: "page-major" is the pool as it is (`KVPool`: a run of pages is one piece); "layer-major" is the
pool before it (one buffer per layer and K/V: 2 x layers pieces per run), kept to measure the change.

Cases: the KV of a 2048-token prompt of the built-in model's shape (30 layers, 3 kv heads, dim 64,
page 16) sent in 4 chunks, with contiguous and with fragmented destination pages; and a large
synthetic pool (256 MiB) in 8 chunks. "TP a->b" (page-major only): the fragmented 2k prompt from a
prefill at TP a to a decode at TP b, each decode rank's heads sliced out of the prefill's heads-first
pages (one piece per page and head group), every rank in its own process with its own transfer engine
as in a server: ranks 1.. of each side run `transfer.rank_agent` (a prefill's serving rank 0's
rank slices); rank 0 is the manager. Their "raw pieces" column is "nan": the pieces lie in several
processes, which no single backend call reaches.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time
from math import nan
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PAGE = 16
CASES = {  # name: (layers, KV heads, dim, prompt tokens, chunks, fragmented destination, prefill TP, decode TP)
    "2k-prompt contiguous": (30, 3, 64, 2048, 4, False, 1, 1),
    "2k-prompt fragmented": (30, 3, 64, 2048, 4, True, 1, 1),
    "256MiB pool": (32, 8, 128, 1024, 8, False, 1, 1),
    "2k-prompt fragmented TP 1->3": (30, 3, 64, 2048, 4, True, 1, 3),
    "2k-prompt fragmented TP 3->1": (30, 3, 64, 2048, 4, True, 3, 1),
}


def make_buffers(layout: str, device: str, layers: int, heads: int, dim: int, pages: int, tp: int = 1):
    """The registered KV memory in `layout` and its BufferInfos (the tensors must outlive the manager);
    page-major at TP `tp`: rank 0's pool, its share of the heads (the followers': `follower_rank`)."""
    import torch

    from common.memory.kv_pool import BufferInfo, KVPool
    from common.wire.kv_heads import rank_heads

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if layout == "page-major":
        pool = KVPool(layers, pages, PAGE, len(rank_heads(heads, tp, 0)), dim, dtype, device)
        pool.buffer.fill_(1)
        return [pool.buffer], pool.buffer_infos()
    bufs = [torch.ones((pages + 1) * PAGE, heads, dim, dtype=dtype, device=device) for _ in range(2 * layers)]
    bpp = PAGE * heads * dim * bufs[0].element_size()
    return bufs, [BufferInfo(b.data_ptr(), b.numel() * b.element_size(), bpp) for b in bufs]


def follower_rank(backend, device, layers, heads, dim, pages, tp, rank, serve, q_out, q_in) -> None:
    """Rank `rank` of `tp`: its own pool (its heads) and engine, its agent's report sent to rank 0."""
    import torch

    from common.memory.kv_pool import KVPool
    from common.wire.kv_heads import rank_heads
    from transfer.backends.factory import make_backend
    from transfer.rank_agent import RankAgent

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    pool = KVPool(layers, pages, PAGE, len(rank_heads(heads, tp, rank)), dim, dtype, device)
    pool.buffer.fill_(1)
    engine = make_backend(backend, "127.0.0.1", on_cuda=device == "cuda", device_index=pool.device_index)
    agent = RankAgent(
        engine,
        (pool.buffer.data_ptr(), pool.total_bytes, pool.bytes_per_page),
        device == "cuda",
        "127.0.0.1",
        None,
        serve,
        pool.device_index,
    )
    q_out.put(agent.report())
    parent = os.getppid()
    while os.getppid() == parent:  # until told to stop, or the side that started it is gone
        try:
            q_in.get(timeout=1)
            break
        except queue.Empty:
            pass
    os._exit(0)


def start_followers(backend, device, layers, heads, dim, pages, tp, serve) -> tuple[list, list]:
    """Ranks 1..tp-1, each in its own process: their reports, and what ends them (put anything)."""
    ctx = mp.get_context("spawn")
    reports, stops = [], []
    for rank in range(1, tp):
        q_out, q_in = ctx.Queue(), ctx.Queue()
        args = (backend, device, layers, heads, dim, pages, tp, rank, serve, q_out, q_in)
        ctx.Process(target=follower_rank, args=args).start()
        reports.append(q_out.get(timeout=120))
        stops.append(q_in)
    return reports, stops


def stop_followers(manager) -> None:
    """Tell the followers to exit, flushing the queues first (os._exit skips their feeder threads)."""
    for stop in manager.follower_stops:
        stop.put("stop")
        stop.close()
        stop.join_thread()


def make_manager(mode, backend, device, layout, layers, heads, dim, pages, aux, tp=1, checksum=False):
    from transfer.decode.decode_manager import DecodeKVManager
    from transfer.manager import KVArgs
    from transfer.prefill.prefill_manager import PrefillKVManager

    bufs, infos = make_buffers(layout, device, layers, heads, dim, pages, tp)
    followers, stops = start_followers(backend, device, layers, heads, dim, pages, tp, mode == "prefill")
    args = KVArgs(
        [*(i.data_ptr for i in infos), *(f.kv_ptr for f in followers)],
        [*(i.nbytes for i in infos), *(f.kv_nbytes for f in followers)],
        [*(i.bytes_per_page for i in infos), *(f.bytes_per_page for f in followers)],
        pages,
        PAGE,
        backend=backend,
        on_cuda=device == "cuda",
        device_index=bufs[0].device.index or 0,
        aux_ptr=aux.data_ptr() if aux is not None else 0,
        aux_record_bytes=64 if aux is not None else 0,
        aux_slots=1 if aux is not None else 0,
        tp_size=tp,
        kv_heads=heads,
        rank_addresses=[f.backend_address for f in followers],
        rank_device_indices=[f.device_index for f in followers],
        rank_agents=[(f.agent_endpoint, f.agent_id) for f in followers if f.agent_endpoint],
        kv_checksum=checksum,
    )
    manager = (PrefillKVManager if mode == "prefill" else DecodeKVManager)(args)
    manager.follower_stops = stops
    manager.bench_wake = threading.Event()  # woken as a server's scheduler is
    manager.wake_scheduler = manager.bench_wake.set
    return manager, bufs


def decode_side(backend, device, layout, case, q_out, q_in, sums=(False,)):
    import torch

    from transfer.decode.receiver import KVReceiver

    layers, heads, dim, tokens, _, frag, src_tp, dst_tp = CASES[case]
    pages = tokens // PAGE
    aux = torch.zeros(1, 64, dtype=torch.uint8)
    room = pages * max(2, src_tp, dst_tp)  # rank 0's buffer takes the raw one-piece write of every rank's bytes
    manager, bufs = make_manager("decode", backend, device, layout, layers, heads, dim, room, aux, dst_tp, sums[0])
    endpoint, prefill_id, rooms = q_in.get()
    dst = list(range(1, 2 * pages + 1, 2)) if frag else list(range(1, pages + 1))
    q_out.put(manager.instance_id)
    for room_id in range(rooms):
        manager.args.kv_checksum = sums[room_id % len(sums)]  # in step with the prefill's rounds
        r = KVReceiver(manager, room_id, endpoint, prefill_id)
        r.init(dst, 0)
        wait_until_done(manager, r)
        r.release()
    q_in.get()
    stop_followers(manager)
    os._exit(0)


def wait_until_done(manager, end, until=None) -> None:
    """Sleep until the room of `end` (a KVSender or KVReceiver) reaches `until` or ends, woken as a
    server's scheduler is (the manager's wake_scheduler): polling in a loop would take the CPU that the
    transfer needs."""
    from transfer.poll import KVPoll

    done = {KVPoll.Success, KVPoll.Failed} | ({until} if until is not None else set())
    while end.poll() not in done:
        manager.bench_wake.wait(0.05)
        manager.bench_wake.clear()


def send_room(manager, room_id: int, pages: int, chunks: int) -> tuple[float, list[int]]:
    """Seconds from queueing a room's first chunk to its success (the aux record written last), and
    the destination pages the decode asked for."""
    from transfer.poll import KVPoll
    from transfer.prefill.sender import KVSender

    s = KVSender(manager, room_id)
    wait_until_done(manager, s, KVPoll.WaitingForInput)
    per = pages // chunks
    t0 = time.perf_counter()
    for c in range(chunks):
        last = c == chunks - 1
        s.send(list(range(1 + c * per, 1 + (c + 1) * per)), is_last=last, aux=bytes(64) if last else None)
    wait_until_done(manager, s)
    elapsed = time.perf_counter() - t0
    if s.poll() != KVPoll.Success:
        raise RuntimeError(f"room {room_id} failed: {s.failure_reason}")
    dst_pages = s.room.room_request.dst_pages
    s.release()
    return elapsed, dst_pages


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def prefill_side(backend, device, layout, case, repeat, q_out, q_in, results, sums=(False,)):
    from transfer.prefill.kv_writer import rank_peer

    layers, heads, dim, tokens, chunks, _, src_tp, dst_tp = CASES[case]
    pages = tokens // PAGE
    room = pages * max(src_tp, dst_tp)  # rank 0's buffer holds the raw one-piece write's bytes
    manager, bufs = make_manager("prefill", backend, device, layout, layers, heads, dim, room, None, src_tp, sums[0])
    rounds = (repeat + 1) * len(sums)  # checksums off and on alternate (--kv-checksum both): alike load on both
    q_out.put((manager.endpoint, manager.instance_id, rounds))
    decode_id = q_in.get()
    a, write, peer = manager.args, manager.backend.write_batch, rank_peer(decode_id, 0)
    total = pages * sum(a.bytes_per_page)
    times = {on: [] for on in sums}  # per round: ours, raw in one piece, raw with the room's pieces
    try:
        for room in range(rounds):  # the three alternate, so load from other processes hits them alike
            manager.args.kv_checksum = on = sums[room % len(sums)]
            elapsed, dst_pages = send_room(manager, room, pages, chunks)
            registration = manager.registrations[decode_id]
            slices = manager.writer.rank_slices(registration, list(range(1, pages + 1)), dst_pages)
            pieces = [x for s in slices.values() for x in s[0]]
            raw = raw_pieces = nan
            if layout == "page-major":  # pages 1.. of one pool into pages 1.. of the other, one piece
                one = (
                    [a.kv_ptrs[0] + a.bytes_per_page[0]],
                    [registration.kv_ptrs[0] + registration.bytes_per_page[0]],
                    [total],
                )
                raw = timed(write, peer, *one, a.on_cuda)
            if list(slices) == [(0, 0)]:  # one rank on each side: the room's pieces in one call
                raw_pieces = timed(write, peer, *slices[0, 0], a.on_cuda)
            if room >= len(sums):  # the first rounds warm up connections
                times[on].append((elapsed, raw, raw_pieces))
        medians = [[statistics.median(col) for col in zip(*times[on])] for on in sums]
        results.put([(case, total, len(pieces), *m) for m in medians])
    except Exception as e:
        results.put((case, repr(e)))
    q_out.put("done")
    stop_followers(manager)
    for q in (results, q_out):  # os._exit skips the queues' feeder threads: flush them first
        q.close()
        q.join_thread()
    os._exit(0)


def run_case(backend: str, device: str, layout: str, case: str, repeat: int, sums: tuple = (False,)) -> list:
    """One row per checksum setting in `sums` (their rounds alternate in the same two processes)."""
    ctx = mp.get_context("spawn")
    to_dec, to_pre, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=decode_side, args=(backend, device, layout, case, to_pre, to_dec, sums)),
        ctx.Process(target=prefill_side, args=(backend, device, layout, case, repeat, to_dec, to_pre, results, sums)),
    ]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    if isinstance(out, tuple):
        raise RuntimeError(f"{backend} {case}: {out[1]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="+", default=["mooncake", "nixl"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument(
        "--layouts", nargs="+", choices=["page-major", "layer-major"], default=["page-major", "layer-major"]
    )
    ap.add_argument(
        "--kv-checksum",
        choices=["off", "on", "both"],
        default="off",
        help="--disaggregation-enable-kv-checksum on both sides (TP 1 cases): hash every page run, verify it",
    )
    ns = ap.parse_args()
    # on CUDA the managers choose their transports as servers do (NIXL sets UCX_TLS; Mooncake refuses
    # MC_INTRANODE_NVLINK, whose transport cannot reach the host-memory aux records)
    rows = []
    checksums = {"off": (False,), "on": (True,), "both": (False, True)}[ns.kv_checksum]
    for backend in ns.backends:
        for case in ns.cases:
            for layout in ns.layouts:
                if layout != "page-major" and CASES[case][6:] != (1, 1):
                    continue  # ranks of their own pools: page-major only
                sums = checksums if CASES[case][6:] == (1, 1) else (False,)
                for on, out in zip(sums, run_case(backend, ns.device, layout, case, ns.repeat, sums)):
                    rows.append((backend, layout + (" +sum" if on else ""), *out))
                print(f"  {backend:9} {case:22} {layout:16} done", flush=True)
    print(
        f"\n{'backend':9} {'case':28} {'layout':16} {'MiB':>6} {'pieces':>6} {'ours GB/s':>9} {'raw GB/s':>8}"
        f" {'ratio':>5} {'raw pieces GB/s':>15} {'ratio':>5}"
    )
    for backend, layout, case, total, pieces, ours, raw, raw_pieces in rows:
        print(
            f"{backend:9} {case:28} {layout:16} {total / 2**20:6.1f} {pieces:6d} {total / ours / 1e9:9.3f}"
            f" {total / raw / 1e9:8.3f} {raw / ours:5.2f} {total / raw_pieces / 1e9:15.3f} {raw_pieces / ours:5.2f}"
        )
    print_checksum_cost(rows)


def print_checksum_cost(rows: list[tuple]) -> None:
    """With --kv-checksum both: each case's time per room with checksums over its time without (same rounds)."""
    off = {(b, lay, case): ours for b, lay, case, _, _, ours, *_ in rows if not lay.endswith(" +sum")}
    pairs = [(b, lay[: -len(" +sum")], case, ours) for b, lay, case, _, _, ours, *_ in rows if lay.endswith(" +sum")]
    if pairs:
        print(f"\n{'backend':9} {'case':28} {'layout':16} {'ms/room off':>11} {'on':>7} {'on/off':>6}")
    for b, lay, case, ours in pairs:
        base = off[b, lay, case]
        print(f"{b:9} {case:28} {lay:16} {base * 1e3:11.2f} {ours * 1e3:7.2f} {ours / base:6.3f}")


if __name__ == "__main__":
    main()
