"""NEXTN, EAGLE and EAGLE3 drafting: a draft head guesses from the target's hidden states, either DeepSeek's MTP
layer read from the target's checkpoint (common/model/nextn.py) or an EAGLE or EAGLE3 head from its own
directory (common/model/eagle.py, eagle3.py). All take the same pair and differ only in the module (and in
which of the target's hidden states they read: the final one, or EAGLE3's three layers' inputs, `capture`);
this drafter runs any of them (common/model/draft_head.py says what it asks of one).

Head slot i of a request (its KV: one more layer of the target's pages, at token i's slot) is computed from
the pair (h_i, t_{i+1}): the target's hidden state at position i and the token that followed it. So the
head writes slot i once t_{i+1} is committed; the runner hands it the target's hidden states of every
forward (`take_hidden`), and each request keeps those whose pair the head has not run yet: `pending`, the
hidden states of positions [q, seq_len - 1), where q is the head slots written (all of them pairs of
committed tokens):

    prefill chunk [a, b)   pairs i in [a, b) run at once (t_{i+1} is the prompt's), but for the prompt's
                           last chunk, whose last pair needs the sampled token: pending = [h_{b-1}]
    plain decode step      pending += the step's h (its token is committed next)
    verify                 pending += h of the c committed positions
    propose (k drafts)     catch-up: pairs [q, seq_len - 1) in one forward, its last row's logits give draft 1;
                           each next step feeds (the head's own output, the previous draft) at the next slot.
                           q = seq_len - 1 after it: the drafting slots are written again by the next catch-up

Across PD the prefill's pending (h of the prompt's last position: EAGLE3's is three layers' wide) travels in
the aux record (`hidden_bytes`); the decode's first propose catches up over it as one engine does.

Cached pages: slot i depends on t_{i+1}, one token past it, so a prefix hit gives up its last page
(MemoryManager.reuse_cut) and `kv_computed_len` never passes q + 1 (`computed_cap`).
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardMode
from common.core.request import Req
from common.engine.extend_batch import ExtendRow, build_extend_batch
from common.engine.spec.drafter import Drafter
from common.model.draft_head import DraftHead
from common.model.llama import LlamaForCausalLM

PENDING_MAX = 16  # hidden states a request keeps before the head catches up without drafting


class HiddenHandoff(Protocol):
    """What a PD role asks of a head drafter (NEXTN, EAGLE, EAGLE3): the prompt's last hidden state into and out
    of the aux record."""

    hidden_bytes: int

    def pending_bytes(self, req: Req) -> bytes: ...

    def set_pending_bytes(self, req: Req, raw: bytes) -> None: ...


class HeadDrafter(Drafter):
    writes_kv = True
    needs_hidden = True

    def __init__(
        self, head: DraftHead, target: LlamaForCausalLM, attn: AttentionBackend, req_to_token: torch.Tensor, device: str
    ):
        self.head, self.target, self.attn = head, target, attn
        self.capture = head.capture  # the runner keeps these layers' inputs of every forward (none: the last hidden)
        self.req_to_token, self.device, self.page_size = req_to_token, device, attn.kv_pool.page_size
        self.dtype = next(head.parameters()).dtype
        # a request -> (q, the hidden states of positions [q, q + p)): q head slots written
        self.pending: weakref.WeakKeyDictionary[Req, tuple[int, torch.Tensor]] = weakref.WeakKeyDictionary()
        self.hidden_size = head.hidden_in  # of the target's hidden state per position
        self.hidden_bytes = 4 * self.hidden_size  # in the aux record: float32

    # -- the target's hidden states --------------------------------------------------------------
    @torch.inference_mode()
    def take_hidden(self, reqs: list[Req], spans: list[int], mode: ForwardMode, hidden: torch.Tensor, kept) -> None:
        """The target ran `spans[i]` rows for reqs[i] (in order); `kept[i]`: rows of a verify committed.
        A request that has gathered PENDING_MAX hidden states without drafting (under a grammar) catches up."""
        rows, hs, base = [], [], 0
        for i, (req, n) in enumerate(zip(reqs, spans)):
            h = hidden[base : base + n]
            base += n
            if mode != ForwardMode.EXTEND:
                if len(self._pending(req)) >= PENDING_MAX:
                    row, old = self._catch_up(req)
                    rows.append(row)
                    hs.append(old)
                q, old = self.pending.get(req, (req.seq_len - 1, self._empty()))
                self.pending[req] = (q, torch.cat((old, h[: kept[i]] if kept is not None else h)))
                continue
            a, end = req.kv_len - n, len(req.fill_ids)
            run = n - 1 if a + n == end else n  # the last chunk's last pair waits for the sampled token
            self.pending[req] = (a + run, h[run:].clone())
            if run > 0:
                rows.append(ExtendRow(req.req_pool_idx, req.fill_ids[a + 1 : a + 1 + run], a))
                hs.append(h[:run])
        if rows:
            self._forward(rows, torch.cat(hs), ForwardMode.EXTEND)

    def _catch_up(self, req: Req) -> tuple[ExtendRow, torch.Tensor]:
        """The row of every pending pair, (h_i, t_{i+1}) for i in [q, seq_len - 1), and their h (popped)."""
        q, h = self.pending[req]
        p = len(h)
        self.pending[req] = (q + p, self._empty())
        return ExtendRow(req.req_pool_idx, req.fill_ids[q + 1 : q + 1 + p], q), h

    def _pending(self, req: Req) -> torch.Tensor:
        got = self.pending.get(req)
        return got[1] if got is not None else self._empty()

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, self.hidden_size, device=self.device)

    def set_pending_bytes(self, req: Req, raw: bytes) -> None:
        """A PD decode's request: the prompt's last hidden state, from the aux record."""
        h = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(1, -1)
        self.pending[req] = (len(req.prompt_ids) - 1, h.to(self.device, self.dtype))

    def pending_bytes(self, req: Req) -> bytes:
        """A PD prefill's aux record: the prompt's last hidden state, float32."""
        return self._pending(req)[-1].float().cpu().numpy().tobytes()

    def computed_cap(self, req: Req) -> int:
        """KV a cache may keep: head slot q needs h_q and t_{q+1}, so the tokens [0, q + 1)."""
        got = self.pending.get(req)
        return req.seq_len if got is None else got[0] + 1

    # -- drafting --------------------------------------------------------------------------------
    def propose(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        active = [i for i, k in enumerate(limits) if k > 0 and len(self._pending(reqs[i]))]
        caught = [self._catch_up(reqs[i]) for i in active]
        rows = [row for row, _ in caught]
        hidden = torch.cat([h for _, h in caught]) if caught else None
        while active:
            out = self._forward(rows, hidden, ForwardMode.VERIFY)
            for i, token in zip(active, self.head.draft_tokens(self.target, out).tolist()):
                drafts[i].append(token)
            keep = [j for j, i in enumerate(active) if len(drafts[i]) < limits[i]]
            active, hidden = [active[j] for j in keep], out[keep]
            rows = [
                ExtendRow(reqs[i].req_pool_idx, [drafts[i][-1]], reqs[i].seq_len + len(drafts[i]) - 2) for i in active
            ]
        return drafts

    def _forward(self, rows: list[ExtendRow], hidden: torch.Tensor, mode: ForwardMode) -> torch.Tensor:
        """The head over `rows` (their KV written), the output at each row's last token."""
        batch, _ = build_extend_batch(rows, self.page_size, self.device, self.req_to_token, mode)
        self.attn.init_forward(batch)
        return self.head(self.target, batch, self.attn, hidden)[batch.logits_indices]

    def describe(self) -> str:
        return self.head.describe()
