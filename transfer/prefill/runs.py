"""Page runs contiguous on both sides, and the (src, dst, nbytes) triples of one chunk (numpy, vectorised):
buffers paired by index when both sides have the same layout (`chunk_triples`), grouped by (prefill rank,
decode rank) for the ranks' own transfer engines: rank r to rank r at equal TP sizes (`paired_groups`),
each decode rank's heads sliced out of the prefill ranks' pages when they differ (`rank_groups`)."""

from __future__ import annotations

import numpy as np

Triples = tuple[list[int], list[int], list[int]]  # (src, dst, nbytes) of every piece


def _runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the maximal runs where both page ids advance by one."""
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return starts, lengths


def chunk_triples(src_bases, dst_bases, bytes_per_page, src_pages, dst_pages) -> tuple[list[int], list[int], list[int]]:
    """Triples for every registered buffer and every run of pages contiguous on both sides (with the
    page-major pool: one buffer, one triple per run)."""
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape:
        raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
    if src.size == 0:
        return [], [], []
    starts, lengths = _runs(src, dst)
    sb = np.asarray(src_bases, dtype=np.int64)[:, None]
    db = np.asarray(dst_bases, dtype=np.int64)[:, None]
    bpp = np.asarray(bytes_per_page, dtype=np.int64)[:, None]
    src_ptrs = sb + src[starts][None, :] * bpp
    dst_ptrs = db + dst[starts][None, :] * bpp
    nbytes = lengths[None, :] * bpp
    return (
        src_ptrs.ravel().tolist(),
        dst_ptrs.ravel().tolist(),
        np.broadcast_to(nbytes, src_ptrs.shape).ravel().tolist(),
    )


def rank_groups(src_bases, dst_bases, src_bpp, dst_bpp, head_bytes, plan, src_pages, dst_pages):
    """{(prefill rank, decode rank): triples}: each decode rank's heads of `dst_pages` from the prefill
    rank(s) holding them, grouped by the pair of ranks (each prefill rank's engine writes its own
    groups). The pool keeps a page's heads first, so a segment of consecutive heads is one range of a
    page: one piece per page, or per run of pages when the segment is every head of both ranks' pages
    (equal head counts). `head_bytes`: one head of one page."""
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape:
        raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
    groups: dict[tuple[int, int], Triples] = {}
    for dst_rank, segments in enumerate(plan):
        for seg in segments:
            nbytes = seg.count * head_bytes
            if nbytes == src_bpp == dst_bpp:  # whole pages on both sides: runs
                part = chunk_triples([src_bases[seg.src_rank]], [dst_bases[dst_rank]], [nbytes], src, dst)
            else:
                s = src_bases[seg.src_rank] + src * src_bpp + seg.src_head * head_bytes
                d = dst_bases[dst_rank] + dst * dst_bpp + seg.dst_head * head_bytes
                part = (s.tolist(), d.tolist(), [nbytes] * src.size)
            for acc, new in zip(groups.setdefault((seg.src_rank, dst_rank), ([], [], [])), part):
                acc.extend(new)
    return groups


def paired_groups(src_bases, dst_bases, bytes_per_page, tp_size, src_pages, dst_pages) -> dict[tuple, Triples]:
    """{(rank, rank): triples} at equal TP sizes: rank r's buffers to decode rank r's, a piece per buffer
    and run (a server's pool: one buffer per rank)."""
    per = len(src_bases) // tp_size
    return {
        (r, r): chunk_triples(
            *(x[r * per : (r + 1) * per] for x in (src_bases, dst_bases, bytes_per_page)), src_pages, dst_pages
        )
        for r in range(tp_size)
    }
