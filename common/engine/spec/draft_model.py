"""STANDALONE drafting: a small model of the same tokenizer and attention shape (say the target's first
layers and its head) proposes k tokens greedily, one forward per token.

Its KV lives in the target's pool as extra layers of the same pages (the pool holds the target's layers,
then the draft's: common/ranks/rank_model.py), at the same slots. So it needs no allocator, table or cache
of its own: a page the prefix cache keeps, the host tier copies or a PD prefill sends carries both models'
KV, and the pool's layout (its layer count, the `draft` field of the KV layout) says so to a peer. The draft
writes its KV wherever the target does: it follows every prefill chunk and plain decode step over the same
batch, and writes its own while drafting; `Req.kv_computed_len` counts the tokens both models hold.

Drafting request r (s tokens committed, of which the draft holds kv_computed_len): the first step catches
up over tokens [kv_computed_len, s) (one, or two after a verify that accepted every draft) and its last
logits give draft 1; each further step feeds the previous draft. Draft i's KV lands in the slot the
verify then overwrites with the target's for the same position.
"""

from __future__ import annotations

import torch

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch, ForwardMode
from common.core.request import Req
from common.engine.extend_batch import ExtendRow, build_extend_batch
from common.engine.spec.drafter import Drafter
from common.model.llama import LlamaForCausalLM


class DraftModel(Drafter):
    writes_kv = True

    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: AttentionBackend,
        shares_attn: bool,
        req_to_token: torch.Tensor,
        device: str,
        name: str,
    ):
        """`attn` over the target's pool; `shares_attn`: it is the target's own backend (same heads), so a batch
        the target just ran needs no second init_forward."""
        self.model, self.attn, self.shares_attn = model, attn, shares_attn
        self.req_to_token, self.device, self.name = req_to_token, device, name
        self.page_size = attn.kv_pool.page_size

    @torch.inference_mode()
    def follow(self, batch: ForwardBatch, planned: bool = True) -> None:
        if not (self.shares_attn and planned):
            self.attn.init_forward(batch)
        self.model.model(batch, self.attn)  # its layers write their KV; no logits needed

    def propose(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        active = [i for i, k in enumerate(limits) if k > 0]
        rows = [
            ExtendRow(reqs[i].req_pool_idx, reqs[i].fill_ids[reqs[i].kv_computed_len :], reqs[i].kv_computed_len)
            for i in active
        ]
        while active:
            for i, token in zip(active, self._step(rows)):
                drafts[i].append(token)
            active = [i for i in active if len(drafts[i]) < limits[i]]
            rows = [
                ExtendRow(reqs[i].req_pool_idx, [drafts[i][-1]], reqs[i].seq_len + len(drafts[i]) - 1) for i in active
            ]
        return drafts

    @torch.inference_mode()
    def _step(self, rows: list[ExtendRow]) -> list[int]:
        """One draft forward: each row's greedy next token."""
        batch, _ = build_extend_batch(rows, self.page_size, self.device, self.req_to_token, ForwardMode.VERIFY)
        self.attn.init_forward(batch)
        return self.model(batch, self.attn).argmax(dim=-1).tolist()

    def describe(self) -> str:
        return f"STANDALONE draft {self.name} ({len(self.model.model.layers)} layers)"
