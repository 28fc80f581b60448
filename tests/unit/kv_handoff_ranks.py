"""The decode's TP ranks in the simulated KV handoff (kv_handoff_sim.py): a page of the simulated pool is
KV_HEADS heads of one slot (8 bytes) each, and a decode of R ranks (1, 2 or 4: the heads must split evenly)
holds each rank's heads as its own slice of every page. Each KV write batch of a room goes out as its
ranks' slices, cut by the real `transfer.prefill.runs.head_slices` over `common.wire.kv_heads.head_sources`
(the R rank buffers are interleaved views of the decode's one buffer per layer). One rank's slice can be
made to fail: every other rank's slices (and the aux record) land, then the batch raises, as a backend
whose batch failed part way does."""

from __future__ import annotations

from common.wire.kv_heads import head_sources, rank_heads
from tests.unit.kv_handoff_sim import CONFIG
from transfer.prefill.runs import head_slices


def slice_triples(*args) -> tuple[list[int], list[int], list[int]]:
    """Every rank slice of `head_slices(*args)` in one (src, dst, nbytes) list."""
    out: tuple[list[int], list[int], list[int]] = ([], [], [])
    for part in head_slices(*args).values():
        for acc, new in zip(out, part):
            acc.extend(new)
    return out


HEAD_BYTES = 8  # one slot's KV of one layer
KV_HEADS = CONFIG.page_size
PAGE_BYTES = KV_HEADS * HEAD_BYTES


class RankedWrites:
    """Splits write batches into per-rank slices; remembers the rooms that lost one (`torn_rooms`)."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.plan = head_sources(KV_HEADS, 1, ranks)
        self.failing_rank: int | None = None  # the next batch with KV loses this rank's slice
        self.torn_rooms: set[int] = set()

    def write(self, real, room: int, src_bases, dst_bases, dst_sizes, peer, src, dst, nbytes, *args) -> None:
        """`real(peer, src, dst, nbytes, *args)` once per rank's slice, then once for the rest (the aux
        record); raises after them when a rank's slice was to fail."""
        slices = [([], [], []) for _ in range(self.ranks)]
        rest: tuple[list[int], list[int], list[int]] = ([], [], [])
        for s, d, n in zip(src, dst, nbytes):
            db = next((b for b, size in zip(dst_bases, dst_sizes) if b <= d < b + size), None)
            if db is None:
                for acc, v in zip(rest, (s, d, n)):
                    acc.append(v)
                continue
            sb = max(b for b in src_bases if b <= s)
            src_pages = list(range((s - sb) // PAGE_BYTES, (s - sb + n) // PAGE_BYTES))
            dst_pages = list(range((d - db) // PAGE_BYTES, (d - db + n) // PAGE_BYTES))
            for rank, acc in enumerate(slices):
                rank_base = db + rank_heads(KV_HEADS, self.ranks, rank).start * HEAD_BYTES
                part = slice_triples(
                    [sb], [rank_base], PAGE_BYTES, PAGE_BYTES, HEAD_BYTES, [self.plan[rank]], src_pages, dst_pages
                )
                for a, new in zip(acc, part):
                    a.extend(new)
        failing = self.failing_rank if slices[0][0] else None
        if failing is not None:
            self.failing_rank = None
        for rank, (s, d, n) in enumerate([*slices, rest]):
            if s and rank != failing:
                real(peer, s, d, n, *args)
        if failing is not None:
            self.torn_rooms.add(room)
            raise RuntimeError(f"decode rank {failing}'s slice of room {room} failed (simulated)")
