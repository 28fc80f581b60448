"""A batch's page-table metadata, built on the host from host-side lengths and sent to the device in one
copy, so that no step reads a length back from the device.

Every integer column a forward needs (lengths, FlashInfer's indptr arrays and last-page lengths, and
whatever the caller adds: positions, token ids, new slots) is packed into one int32 host tensor, pinned
on CUDA, and copied with `non_blocking=True`: the host queues the copy and goes on (a copy from pageable
memory would wait for the device to finish its queued work). The host views stay valid for kernels that
plan on the host (FlashInfer's `plan()` reads its indptr arrays there); the device views are what the
forward reads. The lengths' extremes and the page total are Python ints: attention shapes its tensors
with them without asking the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass
class PageMeta:
    seq_lens: torch.Tensor  # [B] int64 on the device: tokens with KV after this forward
    kv_indptr: torch.Tensor  # [B + 1] int32 on the host (pinned on CUDA): request i's pages are entries
    #                         kv_indptr[i]:kv_indptr[i + 1] of the flattened page list
    kv_indptr_device: torch.Tensor  # the same on the device
    last_page_len: torch.Tensor  # [B] int32 on the host: tokens in each request's last page
    qo_indptr: torch.Tensor  # [B + 1] int32 on the host: request i's new tokens are rows qo_indptr[i]:qo_indptr[i + 1]
    max_len: int
    min_len: int
    total_pages: int


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` token slots: the one round-up of tokens to pages."""
    return -(-tokens // page_size)


def upload(columns: list[list[int]], device: str | torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The int32 columns on the host and on the device, from one host tensor and one copy."""
    flat = [x for column in columns for x in column]
    on_cuda = torch.device(device).type == "cuda"
    host = torch.tensor(flat, dtype=torch.int32, pin_memory=on_cuda)
    sizes = [len(c) for c in columns]
    return list(host.split(sizes)), list(host.to(device, non_blocking=True).split(sizes))


def build_page_meta(
    seq_lens: list[int], extend_lens: list[int], page_size: int, device: str | torch.device, extra: list[list[int]]
) -> tuple[PageMeta, list[torch.Tensor]]:
    """Metadata of a batch whose requests hold `seq_lens` tokens after this forward, `extend_lens` of them
    new; `extra` columns ride along in the same copy and come back on the device, in order."""
    num_pages = [pages_for(n, page_size) for n in seq_lens]
    kv_indptr = [0, *accumulate(num_pages)]
    last_page_len = [(n - 1) % page_size + 1 for n in seq_lens]
    qo_indptr = [0, *accumulate(extend_lens)]
    host, dev = upload([seq_lens, kv_indptr, last_page_len, qo_indptr, *extra], device)
    meta = PageMeta(
        seq_lens=dev[0].long(),
        kv_indptr=host[1],
        kv_indptr_device=dev[1],
        last_page_len=host[2],
        qo_indptr=host[3],
        max_len=max(seq_lens, default=0),  # an idle batch (DP attention) has no request
        min_len=min(seq_lens, default=0),
        total_pages=kv_indptr[-1],
    )
    return meta, dev[4:]


def page_indices(meta: PageMeta, rows: torch.Tensor, req_to_token: torch.Tensor, page_size: int) -> torch.Tensor:
    """The batch's page ids, request after request ([total_pages] int32 on the device), gathered from
    req_to_token on the device: its sizes come from the host, so nothing is read back."""
    device = req_to_token.device
    batch = meta.seq_lens.shape[0]
    counts = meta.kv_indptr_device.diff()
    req_of_page = torch.repeat_interleave(torch.arange(batch, device=device), counts, output_size=meta.total_pages)
    page_in_req = torch.arange(meta.total_pages, device=device) - meta.kv_indptr_device[req_of_page]
    return (req_to_token[rows[req_of_page], page_in_req * page_size] // page_size).to(torch.int32)
