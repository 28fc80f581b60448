"""The (src, dst, nbytes) triples of one chunk (numpy, vectorised), one per page run contiguous on both
sides (common.wire.page_runs): buffers paired by index when both sides have the same layout
(`chunk_triples`), and the rank slices the ranks' own transfer engines write, keyed (prefill rank, decode
rank): rank r to rank r at equal TP sizes (`paired_slices`), each decode rank's heads cut out of the
prefill ranks' pages when they differ (`head_slices`)."""

from __future__ import annotations

import numpy as np

from common.wire.page_runs import page_runs

Triples = tuple[list[int], list[int], list[int]]  # (src, dst, nbytes) of every piece
RankSlices = dict[tuple[int, int], Triples]  # (prefill rank, decode rank) -> the pieces that pair writes


def chunk_triples(src_bases, dst_bases, bytes_per_page, src_pages, dst_pages) -> Triples:
    """Triples for every registered buffer and every run of pages contiguous on both sides (with the
    page-major pool: one buffer, one triple per run)."""
    src, dst, lengths = page_runs(src_pages, dst_pages)
    if src.size == 0:
        return [], [], []
    sb = np.asarray(src_bases, dtype=np.int64)[:, None]
    db = np.asarray(dst_bases, dtype=np.int64)[:, None]
    bpp = np.asarray(bytes_per_page, dtype=np.int64)[:, None]
    src_ptrs = sb + src[None, :] * bpp
    dst_ptrs = db + dst[None, :] * bpp
    nbytes = lengths[None, :] * bpp
    return (
        src_ptrs.ravel().tolist(),
        dst_ptrs.ravel().tolist(),
        np.broadcast_to(nbytes, src_ptrs.shape).ravel().tolist(),
    )


def head_slices(src_bases, dst_bases, src_bpp, dst_bpp, head_bytes, plan, src_pages, dst_pages) -> RankSlices:
    """Each decode rank's heads of `dst_pages` from the prefill rank(s) holding them, one rank slice per
    pair of ranks (each prefill rank's engine writes its own). The pool keeps a page's heads first, so a
    segment of consecutive heads is one range of a page: one piece per page, or per run of pages when the
    segment is every head of both ranks' pages (equal head counts). `head_bytes`: one head of one page."""
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape:
        raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
    slices: RankSlices = {}
    for dst_rank, segments in enumerate(plan):
        for seg in segments:
            nbytes = seg.count * head_bytes
            if nbytes == src_bpp == dst_bpp:  # whole pages on both sides: runs
                part = chunk_triples([src_bases[seg.src_rank]], [dst_bases[dst_rank]], [nbytes], src, dst)
            else:
                s = src_bases[seg.src_rank] + src * src_bpp + seg.src_head * head_bytes
                d = dst_bases[dst_rank] + dst * dst_bpp + seg.dst_head * head_bytes
                part = (s.tolist(), d.tolist(), [nbytes] * src.size)
            for acc, new in zip(slices.setdefault((seg.src_rank, dst_rank), ([], [], [])), part):
                acc.extend(new)
    return slices


def paired_slices(src_bases, dst_bases, bytes_per_page, tp_size, src_pages, dst_pages) -> RankSlices:
    """{(rank, rank): triples} at equal TP sizes: rank r's buffers to decode rank r's, a piece per buffer
    and run (a server's pool: one buffer per rank)."""
    per = len(src_bases) // tp_size
    return {
        (r, r): chunk_triples(
            *(x[r * per : (r + 1) * per] for x in (src_bases, dst_bases, bytes_per_page)), src_pages, dst_pages
        )
        for r in range(tp_size)
    }
