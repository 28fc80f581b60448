"""The two layouts transfer_bench.py compares with ours for a prefill and a decode at different TP sizes,
on the same bytes as a room: what each costs the transfer, measured, not modelled.

- layer HND: a page with heads before tokens inside each layer ([layers, K/V, heads, tokens, dim], as
  vLLM's HND blocks): a head group is one range per page, layer and K/V plane, so one piece each.
- staging: gather each decode rank's heads of every page into registered host memory (numpy: the copy
  a real stager makes), then write it in one piece per run of destination pages.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from common.wire.kv_heads import head_sources
from transfer.prefill.kv_writer import head_bytes_of
from transfer.prefill.runs import chunk_triples


def _plan(writer, registration):
    a = writer.args
    return head_sources(a.kv_heads, a.tp_size, registration.tp_size)


def layer_hnd_pieces(writer, registration, layers: int, src_pages: list[int], dst_pages: list[int]):
    """(src, dst, nbytes) of the layer-HND layout: one piece per page, layer, plane and head segment."""
    a = writer.args
    src_bpp, dst_bpp = a.bytes_per_page[0], registration.bytes_per_page[0]
    head_bytes = head_bytes_of(a)
    block = head_bytes // (2 * layers)  # one head's tokens of one layer and plane
    src_heads, dst_heads = src_bpp // head_bytes, dst_bpp // head_bytes
    planes = np.arange(2 * layers, dtype=np.int64)[None, :]
    sp = np.asarray(src_pages, dtype=np.int64)[:, None]
    dp = np.asarray(dst_pages, dtype=np.int64)[:, None]
    out = ([], [], [])
    for dst_rank, segments in enumerate(_plan(writer, registration)):
        for seg in segments:
            s = a.kv_ptrs[seg.src_rank] + sp * src_bpp + (planes * src_heads + seg.src_head) * block
            d = registration.kv_ptrs[dst_rank] + dp * dst_bpp + (planes * dst_heads + seg.dst_head) * block
            out[0].extend(s.ravel().tolist())
            out[1].extend(d.ravel().tolist())
            out[2].extend([seg.count * block] * s.size)
    return out


def _view(ptr: int, pages: int, heads: int, head_bytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * (pages * heads * head_bytes)).from_address(ptr)).reshape(
        pages, heads, head_bytes
    )


def staging_write(manager, registration, src_pages: list[int], dst_pages: list[int]) -> tuple[float, float]:
    """(gather s, write s) of the staging alternative; the staging memory is registered untimed, as a
    server would at start-up."""
    a = manager.args
    head_bytes = head_bytes_of(a)
    src_heads, dst_heads = a.bytes_per_page[0] // head_bytes, registration.bytes_per_page[0] // head_bytes
    n, ranks = len(src_pages), registration.tp_size
    staging = getattr(manager, "bench_staging", None)
    if staging is None:  # registered once: Mooncake refuses a range that overlaps one registered before
        staging = manager.bench_staging = np.zeros((ranks, n, dst_heads, head_bytes), dtype=np.uint8)
        manager.backend.register(staging.ctypes.data, staging.nbytes)
    src_views = [_view(p, nb // a.bytes_per_page[0], src_heads, head_bytes) for p, nb in zip(a.kv_ptrs, a.kv_nbytes)]
    idx = np.asarray(src_pages)
    t0 = time.perf_counter()
    for dst_rank, segments in enumerate(_plan(manager.writer, registration)):
        for seg in segments:
            part = src_views[seg.src_rank][idx, seg.src_head : seg.src_head + seg.count]
            staging[dst_rank, :, seg.dst_head : seg.dst_head + seg.count] = part
    gather_s = time.perf_counter() - t0
    per_rank = n * registration.bytes_per_page[0]
    bases = [staging.ctypes.data + r * per_rank for r in range(ranks)]
    pieces = ([], [], [])
    for r in range(ranks):  # staging page i -> destination page dst_pages[i]
        part = chunk_triples(
            [bases[r]], [registration.kv_ptrs[r]], [registration.bytes_per_page[0]], range(n), dst_pages
        )
        for acc, new in zip(pieces, part):
            acc.extend(new)
    t0 = time.perf_counter()
    manager.backend.write_batch(registration.decode_id, *pieces, False)
    return gather_s, time.perf_counter() - t0
