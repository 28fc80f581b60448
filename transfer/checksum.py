"""KV checksums (`--disaggregation-enable-kv-checksum`, SGLang's flag): the prefill hashes every page run it
writes (xxh3-64 of the source bytes, per registered buffer, on its `kv-checksum` thread while the write runs)
and sends the hashes once the write landed: a chunk's in a `checksums` message, the last one's with the
room's final status. The decode hashes the same pages of its own buffers as each message comes (`PageCheck`:
so only the last chunk's wait at the end), and the room succeeds only if every page of it was covered and
equal. A difference, or a page no hash covers, fails the room: a flipped byte, a write that never landed or
landed elsewhere is caught, never served, never cached.

    entry: [buffer index, first destination page, pages, xxh3-64]      one per piece of a run, per buffer

A run is hashed in pieces of at most PIECE_BYTES (at least a page), on a few threads at once (xxhash lets go
of the GIL): a chunk's hashes take a fraction of one core's time, which matters most for the last chunk, whose
check the room's success waits for. The decode hashes whatever pieces the entries name, so a prefill that cuts
runs otherwise (an older version, during a rolling upgrade) is checked as well.

Host memory at TP 1 on both sides (the pages are read through their addresses; a decode rank of a TP group
would hash its own pages in its own process): common/config.py refuses the flag elsewhere at start-up.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from common.wire.page_runs import page_runs

Sums = list[list[int]]
PIECE_BYTES = 4 << 20  # the most one entry covers (at least one page): a chunk's pieces hash in parallel
_pool: list[ThreadPoolExecutor] = []  # the hasher threads, made on first use (only a server with the flag hashes)


def _hash(address: int, nbytes: int) -> int:
    import xxhash  # only a server with the flag hashes

    return xxhash.xxh3_64_intdigest((ctypes.c_ubyte * nbytes).from_address(address))


def _hash_all(spans: list[tuple[int, int]]) -> list[int]:
    """xxh3-64 of each (address, bytes), several at once when there are several."""
    if len(spans) < 2:
        return [_hash(*span) for span in spans]
    if not _pool:
        _pool.append(ThreadPoolExecutor(min(8, os.cpu_count() or 2), "kv-checksum-piece"))
    return list(_pool[0].map(lambda span: _hash(*span), spans))


def _pieces(n: int, bytes_per_page: int) -> list[tuple[int, int]]:
    """(first page, pages) of a run of `n` pages cut into pieces of at most PIECE_BYTES (one page at least)."""
    step = max(1, PIECE_BYTES // bytes_per_page)
    return [(k, min(step, n - k)) for k in range(0, n, step)]


def page_run_sums(
    ptrs: Sequence[int], bytes_per_page: Sequence[int], src_pages: list[int], dst_pages: list[int]
) -> Sums:
    """The entries of one chunk: its source pages hashed, run by run (the writer's pieces) cut into pieces, in
    every buffer."""
    src, dst, lengths = (x.tolist() for x in page_runs(src_pages, dst_pages))
    entries, spans = [], []
    for b, (ptr, bpp) in enumerate(zip(ptrs, bytes_per_page)):
        for s, d, n in zip(src, dst, lengths):
            for k, m in _pieces(n, bpp):
                entries.append([b, d + k, m])
                spans.append((ptr + (s + k) * bpp, m * bpp))
    return [entry + [digest] for entry, digest in zip(entries, _hash_all(spans))]


class PageCheck:
    """A decode room's pages (`dst_pages`, in every buffer) against the prefill's hashes, as they come."""

    def __init__(self, ptrs: Sequence[int], bytes_per_page: Sequence[int], dst_pages: list[int]):
        self.ptrs, self.bytes_per_page = ptrs, bytes_per_page
        self.expected = {(b, p) for b in range(len(ptrs)) for p in dst_pages}
        self.covered: list[tuple[int, int]] = []
        self.bad: list[str] = []
        self.runs = 0

    def add(self, sums: Sums) -> str | None:
        """Hash the pages of one chunk's entries now (they landed); why they differ, or None."""
        for b, first, n, _ in sums:
            if not 0 <= b < len(self.ptrs) or n < 1:
                return f"a checksum names buffer {b} / {n} pages, outside this decode's layout"
            self.covered += [(b, p) for p in range(first, first + n)]
        spans = [(self.ptrs[b] + first * self.bytes_per_page[b], n * self.bytes_per_page[b]) for b, first, n, _ in sums]
        for (b, first, n, digest), got in zip(sums, _hash_all(spans)):
            if got != digest:
                self.bad.append(f"buffer {b} pages {first}-{first + n - 1}")
        self.runs += len(sums)
        if self.bad:
            return f"KV checksum mismatch in {len(self.bad)} of {self.runs} page runs ({', '.join(self.bad[:3])})"
        return None

    def final(self, sums: Sums) -> str | None:
        """The last chunk's entries, then whether every page of the room was covered exactly once."""
        problem = self.add(sums)
        if problem is None and (len(self.covered) != len(self.expected) or set(self.covered) != self.expected):
            return (
                f"the checksums cover {len(set(self.covered) & self.expected)} of the room's {len(self.expected)} pages"
            )
        return problem


def mismatch(ptrs: Sequence[int], bytes_per_page: Sequence[int], dst_pages: list[int], sums: Sums) -> str | None:
    """Why the room's pages do not hold what the prefill hashed (all its entries at once), or None."""
    return PageCheck(ptrs, bytes_per_page, dst_pages).final(sums)
