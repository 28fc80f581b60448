"""Runs of pages contiguous on both sides of a copy: the one rule by which a transfer (transfer.prefill.runs)
and the host tier's copies (common.memory.host_pool) turn page lists into as few pieces as they can."""

from __future__ import annotations

import numpy as np


def page_runs(src_pages, dst_pages) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source start pages, destination start pages, lengths) of the maximal runs where both page ids go
    up by one together, in order."""
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape:
        raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
    if src.size == 0:
        return src, dst, src
    starts = np.concatenate(([0], np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lengths
