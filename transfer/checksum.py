"""KV checksums (`--disaggregation-enable-kv-checksum`, SGLang's flag): the prefill hashes every page run it
writes (xxh3-64 of the source bytes, per registered buffer), sends the hashes with the room's final status,
and the decode hashes the same pages of its own buffers before the room's pages may be read or cached. A
difference, or a page of the room no hash covers, fails the room: a flipped byte, a write that never landed
or landed elsewhere is caught, never served, never cached.

    entry: [buffer index, first destination page, pages, xxh3-64]      one per run and buffer

Host memory at TP 1 on both sides (the pages are read through their addresses; a decode rank of a TP group
would hash its own pages in its own process): common/config.py refuses the flag elsewhere at start-up.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from common.wire.page_runs import page_runs

Sums = list[list[int]]


def _hash(address: int, nbytes: int) -> int:
    import xxhash  # only a server with the flag hashes

    return xxhash.xxh3_64_intdigest((ctypes.c_ubyte * nbytes).from_address(address))


def page_run_sums(
    ptrs: Sequence[int], bytes_per_page: Sequence[int], src_pages: list[int], dst_pages: list[int]
) -> Sums:
    """The entries of one chunk: its source pages hashed, run by run (the writer's pieces), in every buffer."""
    src, dst, lengths = (x.tolist() for x in page_runs(src_pages, dst_pages))
    return [
        [b, d, n, _hash(ptr + s * bpp, n * bpp)]
        for b, (ptr, bpp) in enumerate(zip(ptrs, bytes_per_page))
        for s, d, n in zip(src, dst, lengths)
    ]


def mismatch(ptrs: Sequence[int], bytes_per_page: Sequence[int], dst_pages: list[int], sums: Sums) -> str | None:
    """Why the room's pages (`dst_pages`, in every buffer) do not hold what the prefill hashed, or None."""
    expected = {(b, p) for b in range(len(ptrs)) for p in dst_pages}
    covered: list[tuple[int, int]] = []
    bad = []
    for b, first, n, digest in sums:
        if not 0 <= b < len(ptrs) or n < 1:
            return f"a checksum names buffer {b} / {n} pages, outside this decode's layout"
        covered += [(b, p) for p in range(first, first + n)]
        if _hash(ptrs[b] + first * bytes_per_page[b], n * bytes_per_page[b]) != digest:
            bad.append(f"buffer {b} pages {first}-{first + n - 1}")
    if len(covered) != len(expected) or set(covered) != expected:
        return f"the checksums cover {len(set(covered) & expected)} of the room's {len(expected)} pages"
    if bad:
        return f"KV checksum mismatch in {len(bad)} of {len(sums)} page runs ({', '.join(bad[:3])})"
    return None
