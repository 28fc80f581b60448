"""An EXTEND forward's batch from per-request rows of new tokens: a prefill chunk, a speculative verify (the
last token and its drafts) or a draft model's step. Built on the host and sent in one copy (page_meta.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.core.forward_batch import ForwardBatch, ForwardMode
from common.core.page_meta import build_page_meta


@dataclass
class ExtendRow:
    """One request's new tokens: they sit at positions start.. of request row `row` of req_to_token."""

    row: int
    tokens: list[int]
    start: int
    rope_len: int | None = None  # length-dependent RoPE: every token's; None: each its position + 1, as a decode step
    all_logits: bool = False  # logits of every new token (verify, prompt logprobs), else of the last only

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def build_extend_batch(
    rows: list[ExtendRow],
    page_size: int,
    device: str,
    req_to_token: torch.Tensor,
    mode: ForwardMode = ForwardMode.EXTEND,
) -> tuple[ForwardBatch, list[tuple[int, int]]]:
    """The batch, and per row the span of logits rows it got (its last token's alone, or all of them);
    `mode` VERIFY for a few tokens per request (attention may batch them)."""
    ids, positions, rope_lens, logits_idx, spans = [], [], [], [], []
    token_start = 0
    for r in rows:
        n = len(r.tokens)
        ids.extend(r.tokens)
        positions.extend(range(r.start, r.end))
        rope_lens.extend([r.rope_len] * n if r.rope_len is not None else range(r.start + 1, r.end + 1))
        first = token_start if r.all_logits else token_start + n - 1
        spans.append((len(logits_idx), len(logits_idx) + token_start + n - first))
        logits_idx.extend(range(first, token_start + n))
        token_start += n
    seq_lens, extend_lens = [r.end for r in rows], [len(r.tokens) for r in rows]
    pages, (ids_d, positions_d, rope_lens_d, rows_d, logits_d) = build_page_meta(
        seq_lens, extend_lens, page_size, device, [ids, positions, rope_lens, [r.row for r in rows], logits_idx]
    )
    slots = [req_to_token[r.row, r.start : r.end] for r in rows]
    batch = ForwardBatch(
        mode=mode,
        input_ids=ids_d.long(),
        positions=positions_d.long(),
        out_cache_loc=torch.cat(slots).to(device=device, dtype=torch.int64),
        req_pool_indices=rows_d.long(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        extend_lens=torch.tensor(extend_lens, dtype=torch.int64),
        logits_indices=logits_d.long(),
        req_to_token=req_to_token,
        pages=pages,
        rope_lens=rope_lens_d.long(),
    )
    return batch, spans
