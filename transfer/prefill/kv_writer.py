"""The prefill's data plane: one chunk of a room's KV pages (and, on the last chunk, the aux record)
written into the decode's registered memory through the transfer backend.

Every write is checked against what the decode registered: page ids inside its pool (the control plane
already refused requests outside it) and a layout that fits ours (checked once, at registration: see
`registration_problem`), so a decode's claim can never make us write out of bounds. A decode at another
TP size receives, in each of its ranks' buffers, exactly that rank's KV heads (`KVWriter.rank_slices`).

Per-rank engines: a chunk's pieces are cut into rank slices, one per (prefill rank, decode rank). Rank 0
writes its own slices with its own engine, and each follower's slice goes to that follower's agent
(transfer.prefill.rank_links), which writes it with the follower's engine; the ranks at once, each
rank's slices one after another (one engine writing to several decode ranks at once was 3x slower with
NIXL). The aux record goes last, once every slice landed (at TP 1 on both sides, the one slice and the
record are one batch on the host), so the record lands only after every rank's slice, and any failure
fails the chunk only after every slice finished or failed: nothing of the room lands after its status.

Ordering: rank 0 waits on the chunk's `ready` event (recorded after its forward) before any slice is
issued. A follower's pages of that forward are written by then: each layer's attention writes the
rank's KV before its row-parallel o_proj all-reduce, which rank 0's forward waited on (on the CPU,
gloo returns only once every rank contributed; on CUDA, NCCL's kernel on the follower's stream runs
after its KV writes, and rank 0's copy of that all-reduce, before its event, completes only after it).
"""

from __future__ import annotations

import ctypes
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager

from common.wire.kv_heads import head_sources, rank_heads, split_problem
from transfer.backends.base import TransferBackend
from transfer.bulk_priority import lower_this_thread
from transfer.manager import KVArgs
from transfer.messages import Register, RoomRequest
from transfer.poll import Mark, no_mark
from transfer.prefill.rank_links import RankLinks
from transfer.prefill.runs import RankSlices, head_slices, paired_slices

SLICE_WRITERS = 16  # prefill ranks writing at once, over every decode (a chunk's slices: one thread per rank)


def rank_peer(decode_id: str, rank: int) -> str:
    """How a prefill's engines name decode rank `rank`'s engine."""
    return f"{decode_id}/tp{rank}"


class AuxStaging:
    """Registered host memory that aux records are written from: one slot per write in flight, so
    workers of different decodes never share a buffer."""

    def __init__(self, backend: TransferBackend, slots: int = 64, slot_bytes: int = 4096):
        self.slot_bytes = slot_bytes
        self.buffer = (ctypes.c_uint8 * (slots * slot_bytes))()
        backend.register(ctypes.addressof(self.buffer), len(self.buffer))
        self._free = list(range(slots))
        self._available = threading.Semaphore(slots)
        self._lock = threading.Lock()

    @contextmanager
    def slot(self, record: bytes) -> Iterator[int]:
        """The address of a slot holding `record`, for the duration of one write."""
        if len(record) > self.slot_bytes:
            raise ValueError(f"aux record of {len(record)} bytes exceeds the {self.slot_bytes}-byte staging slot")
        self._available.acquire()
        with self._lock:
            index = self._free.pop()
        try:
            addr = ctypes.addressof(self.buffer) + index * self.slot_bytes
            ctypes.memmove(addr, record, len(record))
            yield addr
        finally:
            with self._lock:
                self._free.append(index)
            self._available.release()


def registration_problem(mine: KVArgs, registration: Register) -> str | None:
    """Why we must never write into what `registration` registered (naming the field), or None when it
    fits: the same page size and KV heads, and one buffer per decode rank holding exactly its heads."""
    if registration.page_size != mine.page_size:
        return f"page_size: decode has {registration.page_size}, prefill has {mine.page_size}"
    if registration.kv_heads != mine.kv_heads:
        return (
            f"kv_heads: decode has {registration.kv_heads}, prefill has {mine.kv_heads} "
            "(another model, or a Tandem before heads-first pages, which sends 1: run one version on both)"
        )
    problem = split_problem(registration.kv_heads, registration.tp_size)
    if problem is not None:
        return f"decode layout: {problem}"
    expected = mine.bytes_per_page
    if registration.tp_size != mine.tp_size:  # a page of the decode's ranks: its share of the heads
        head_bytes = head_bytes_of(mine)
        expected = [head_bytes * len(rank_heads(mine.kv_heads, registration.tp_size, 0))] * registration.tp_size
    if len(registration.kv_ptrs) != len(expected):
        return (
            f"kv_ptrs: decode registered {len(registration.kv_ptrs)} KV buffers, prefill expects {len(expected)} "
            f"(one per rank of its tp_size {registration.tp_size}: run one Tandem version on both)"
        )
    if registration.bytes_per_page != expected:
        return f"bytes_per_page: decode has {registration.bytes_per_page[:4]}..., prefill expects {expected[:4]}..."
    if mine.aux_record_bytes and registration.aux_record_bytes != mine.aux_record_bytes:
        return f"aux_record_bytes: decode has {registration.aux_record_bytes}, prefill writes {mine.aux_record_bytes}"
    return None


def head_bytes_of(args: KVArgs) -> int:
    """One KV head of one page (a prefill rank's page holds its heads one after another)."""
    return args.bytes_per_page[0] // len(rank_heads(args.kv_heads, args.tp_size, 0))


class KVWriter:
    def __init__(self, backend: TransferBackend, args: KVArgs, links: RankLinks | None = None):
        """`links`: the followers' agents (None at TP 1)."""
        self.backend, self.args, self.on_cuda, self.links = backend, args, args.on_cuda, links
        self.aux_staging = AuxStaging(backend)
        self.page_bytes = sum(args.bytes_per_page)  # one page across every rank's buffer: what a page sends
        self.rank_bytes: Counter[int] = Counter()  # bytes each prefill rank's own engine wrote
        self._lock = threading.Lock()
        self._slice_writers = ThreadPoolExecutor(SLICE_WRITERS, "kv-rank-write", initializer=lower_this_thread)

    def rank_slices(self, registration: Register, src_pages: list[int], dst_pages: list[int]) -> RankSlices:
        """{(prefill rank, decode rank): (src, dst, nbytes)} of a chunk: buffers paired by index at equal TP
        size, else each decode rank's heads cut out of the prefill ranks' pages (common.wire.kv_heads)."""
        a = self.args
        if registration.tp_size == a.tp_size:
            return paired_slices(a.kv_ptrs, registration.kv_ptrs, a.bytes_per_page, a.tp_size, src_pages, dst_pages)
        plan = head_sources(a.kv_heads, a.tp_size, registration.tp_size)
        return head_slices(
            a.kv_ptrs,
            registration.kv_ptrs,
            a.bytes_per_page[0],
            registration.bytes_per_page[0],
            head_bytes_of(a),
            plan,
            src_pages,
            dst_pages,
        )

    def write(
        self,
        registration: Register,
        room_request: RoomRequest,
        src_pages: list[int],
        dst_pages: list[int],
        aux: bytes | None,
        fence: Callable[[], None],
        mark: Mark = no_mark,
    ) -> int:
        """The pages and, on the last chunk, the aux record; returns the KV bytes written, raises on any
        failure of a slice (after every slice ended). The prefill ranks at once (each its slices in turn),
        then the record; one slice alone (TP 1 on both sides) goes with the record in one batch when on the host (one round trip:
        the decode reads the record only after the status, sent once the whole batch landed); device KV
        and the host record take a batch each. `fence()` runs before each round of backend calls and raises when the
        decode may no longer be written to; `mark` records the writes on the request's timeline."""
        slices = self.rank_slices(registration, src_pages, dst_pages)
        src, dst, nbytes = slices.pop((0, 0)) if len(slices) == 1 else ([], [], [])
        written = self._write_slices(registration, room_request.decode_id, slices, fence) + sum(nbytes)
        peer = rank_peer(room_request.decode_id, 0)
        if aux is not None and not self.on_cuda:
            self._write_with_aux(registration, room_request, aux, src, dst, nbytes, fence)
            self._count(0, sum(nbytes))
            mark("chunk_written")
            mark("aux_written")
            return written
        if src:
            fence()
            self.backend.write_batch(peer, src, dst, nbytes, self.on_cuda)  # each backend splits as it must
            self._count(0, sum(nbytes))
        mark("chunk_written")
        if aux is not None:
            self._write_with_aux(registration, room_request, aux, [], [], [], fence)
            mark("aux_written")
        return written

    def _write_slices(self, registration: Register, decode_id: str, slices: RankSlices, fence: Callable) -> int:
        """Each prefill rank's slices in decode-rank order by its own engine, the ranks at once; waits
        for all, then raises the first failure (in rank order) or returns the bytes written. (One engine
        writing to several decode ranks at once ran 3x slower with NIXL: `docs/performance.md`.)"""
        if not slices:
            return 0
        fence()
        by_source: dict[int, list] = {}
        for (src_rank, dst_rank), triples in sorted(slices.items()):
            by_source.setdefault(src_rank, []).append((dst_rank, triples))
        futures = [
            self._slice_writers.submit(self._write_rank_slices, registration, decode_id, src_rank, own)
            for src_rank, own in by_source.items()
        ]
        wait(futures)
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        return sum(f.result() for f in futures)

    def _write_rank_slices(self, registration: Register, decode_id: str, src_rank: int, slices: list) -> int:
        return sum(self._write_slice(registration, decode_id, src_rank, dst, triples) for dst, triples in slices)

    def _write_slice(self, registration: Register, decode_id: str, src_rank: int, dst_rank: int, triples) -> int:
        peer, n = rank_peer(decode_id, dst_rank), sum(triples[2])
        if src_rank == 0:
            self.backend.write_batch(peer, *triples, self.on_cuda)
        else:
            address, device = registration.backend_addresses[dst_rank], registration.device_indices[dst_rank]
            n = self.links.write(src_rank, peer, address, device, *triples, self.on_cuda)
        self._count(src_rank, n)
        return n

    def _count(self, rank: int, nbytes: int) -> None:
        with self._lock:
            self.rank_bytes[rank] += nbytes

    def _write_with_aux(
        self,
        registration: Register,
        room_request: RoomRequest,
        aux: bytes,
        src: list[int],
        dst: list[int],
        nbytes: list[int],
        fence: Callable[[], None],
    ) -> None:
        """One host-memory batch into decode rank 0: the pieces given, then the aux record into the
        room's slot."""
        if len(aux) != registration.aux_record_bytes:
            raise ValueError(f"aux record of {len(aux)} bytes, decode expects {registration.aux_record_bytes}")
        with self.aux_staging.slot(aux) as src_aux:
            fence()
            self.backend.write_batch(
                rank_peer(room_request.decode_id, 0),
                [*src, src_aux],
                [*dst, registration.aux_ptr + room_request.aux_slot * registration.aux_record_bytes],
                [*nbytes, len(aux)],
            )

    def close(self) -> None:
        self._slice_writers.shutdown(wait=False, cancel_futures=True)
