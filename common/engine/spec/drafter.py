"""The drafter seam: what the verify step needs from any way of guessing the next tokens.

A drafter proposes, per running request, at most `limits[i]` tokens that continue its committed tokens
(`Req.fill_ids`). One that runs a model (`writes_kv`) keeps that model's KV in the target's pages (extra
layers, common/engine/spec/draft_model.py): it proposes inside the runner, after the verify's slots are
allocated, and follows every other target forward (prefill chunks, plain decode steps) over the same batch,
so a page's draft KV is written wherever its target KV is. One that does not (NGRAM) proposes while the
step is planned, and a step where no request got a draft is a plain decode step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from common.core.forward_batch import ForwardBatch
from common.core.request import Req


class Drafter(ABC):
    writes_kv = False  # a draft model: its KV is part of every page (kv_computed_len covers both models)
    needs_hidden = False  # a head (NEXTN, EAGLE, EAGLE3): the runner hands it the target's hidden states (take_hidden)

    @abstractmethod
    def propose(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        """Per request at most `limits[i]` draft tokens (possibly none)."""

    def follow(self, batch: ForwardBatch, planned: bool = True) -> None:
        """The target just ran `batch` (a prefill chunk or a decode step): write the draft's KV for it too.
        `planned`: the target's attention backend is planned for `batch` (not when a CUDA graph replayed it)."""

    def computed_cap(self, req: Req) -> int:
        """The most tokens of `req` whose KV every model holds for the prefix cache (a draft head lags the target)."""
        return req.seq_len

    def describe(self) -> str:
        return type(self).__name__
