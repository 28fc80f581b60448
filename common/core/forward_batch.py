"""What one model forward needs to know about the batch: small, tensor-only, built by the runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.core.page_meta import PageMeta

if TYPE_CHECKING:
    from common.lora.batch import LoraBatch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: new tokens of each request on top of its cached prefix
    DECODE = "decode"  # one new token per request
    VERIFY = "verify"  # a few new tokens per request on top of its KV (speculative verify, draft steps): an
    #                    EXTEND whose attention may batch the requests (common/attention/torch_backend.py)


@dataclass(frozen=True)
class DPStep:
    """Under DP attention, every rank's share of this forward (each rank runs its own batch): new tokens
    and logits rows per rank, in rank order. A rank of zero tokens runs an idle batch."""

    tokens: list[int]
    rows: list[int]


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, all requests' new tokens concatenated
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of every new token
    req_pool_indices: torch.Tensor  # [B] int64, row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] int64 on CPU, tokens with KV after this forward
    extend_lens: torch.Tensor  # [B] int64 on CPU, new tokens per request (1 in decode)
    logits_indices: torch.Tensor  # [L] int64, rows of the hidden states that need logits
    req_to_token: torch.Tensor  # the whole ReqToTokenPool table
    pages: PageMeta  # the page table's metadata, on the host and the device (built from host-side lengths)
    # [T] int64 on the device: for length-dependent RoPE, each new token's request length (EXTEND: once its
    # whole prefill is done, so chunking does not change the angles; DECODE: seq_lens)
    rope_lens: torch.Tensor
    dp: DPStep | None = None  # set under DP attention
    lora: LoraBatch | None = None  # --enable-lora: which rows run under which adapter slot (common/lora/batch.py)

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])
