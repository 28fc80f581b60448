"""Every row's sampling settings as tensors, built once per batch composition.

A decode batch keeps its SamplingBatch from step to step; advance() adds the tokens just sampled to the
penalty state and moves every row's random stream on by one, all in place. What no row asks for (logit
bias, a minimum of new tokens, penalties) costs nothing: its tensors are None and the sampler skips it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from common.engine.grammar.req_grammar import ReqGrammar


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    top_logprobs_num: int = 0
    return_logprob: bool = False
    stop_ids: frozenset[int] = frozenset()  # tokens that end the request: masked until min_new_tokens are out
    grammar: ReqGrammar | None = None  # its allowed tokens are filled into the batch's bitmask every step


def wrap_int64(x: int) -> int:
    """A Python int as the int64 with the same low 64 bits (seed + choice index may pass INT64_MAX)."""
    return (x + 2**63) % 2**64 - 2**63


class SamplingBatch:
    def __init__(self, rows: list[SamplingRow], vocab_size: int, device: str | torch.device):
        params = [r.params for r in rows]
        self.size, self.device = len(rows), device
        self.rows = torch.arange(len(rows), device=device)
        self._init_choice(params, vocab_size)
        self.seeded = torch.tensor([p.seed is not None for p in params], device=device)
        self.any_seeded = any(p.seed is not None for p in params)
        self.seeds = torch.tensor([wrap_int64(p.seed or 0) for p in params], dtype=torch.int64, device=device)
        self.steps = torch.tensor(
            [len(r.output_ids) for r in rows], dtype=torch.int64, device=device
        )  # tokens sampled so far
        self.return_logprob = [r.return_logprob for r in rows]
        self.top_logprobs_num = [r.top_logprobs_num if r.return_logprob else 0 for r in rows]
        self.want_logprobs = any(self.return_logprob)
        self.max_top_logprobs = max(self.top_logprobs_num, default=0)
        self.penalized = any(p.has_penalties for p in params)
        if self.penalized:
            self._init_penalties(rows, vocab_size)
        self._init_logit_bias(params)
        self._init_min_tokens(rows)
        self.grammar = None  # a GrammarMask when a row is constrained (its matchers move on between steps)
        if any(r.grammar is not None for r in rows):
            from common.engine.grammar.mask import GrammarMask  # xgrammar only where a grammar is used

            self.grammar = GrammarMask([r.grammar for r in rows], [r.output_ids for r in rows], device)

    def _init_logit_bias(self, params: list[SamplingParams]) -> None:
        """(row, token, bias) of every bias asked for, as three flat tensors; None when no row asks."""
        entries = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        self.bias_rows, self.bias_ids, self.bias_values = self._columns(
            entries, torch.int64, torch.int64, torch.float32
        )

    def _init_min_tokens(self, rows: list[SamplingRow]) -> None:
        """(row, stop token) of the rows still short of their min_new_tokens, and each pair's minimum:
        the token is masked while the row has sampled fewer (`steps`); None when no row is short."""
        pairs = [
            (i, t, r.params.min_new_tokens)
            for i, r in enumerate(rows)
            if len(r.output_ids) < r.params.min_new_tokens
            for t in sorted(r.stop_ids)
        ]
        self.min_rows, self.min_ids, self.min_tokens = self._columns(pairs, torch.int64, torch.int64, torch.int64)

    def _columns(self, entries: list[tuple], *dtypes: torch.dtype) -> list[torch.Tensor | None]:
        """The columns of `entries` as tensors of `dtypes` on the batch's device; all None when there are none."""
        if not entries:
            return [None] * len(dtypes)
        return [torch.tensor(col, dtype=dt, device=self.device) for col, dt in zip(zip(*entries), dtypes)]

    def _init_choice(self, params: list[SamplingParams], vocab_size: int) -> None:
        dev = self.device
        self.greedy = torch.tensor([p.is_greedy for p in params], device=dev)
        self.all_greedy = all(p.is_greedy for p in params)
        self.temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=dev)[:, None]
        # top-k and top-p work on the rows that ask for them only (a sort of the whole batch costs)
        ks = [p.top_k if 0 < p.top_k < vocab_size and not p.is_greedy else 0 for p in params]
        self.top_k_rows = self._rows_where([k > 0 for k in ks])
        self.max_top_k = max(ks, default=0)
        self.top_k_index = torch.tensor([k - 1 for k in ks if k > 0], device=dev)[:, None]
        self.top_p_rows = self._rows_where([p.top_p < 1.0 and not p.is_greedy for p in params])
        self.top_p = torch.tensor([p.top_p for p in params if p.top_p < 1.0 and not p.is_greedy], device=dev)[:, None]
        # every row's, for FlashInfer's kernels: the whole vocabulary / 1.0 where a row does not ask
        self.top_ks = torch.tensor([k or vocab_size for k in ks], dtype=torch.int32, device=dev)
        self.top_ps = torch.tensor([p.top_p if not p.is_greedy else 1.0 for p in params], device=dev)
        self.use_min_p = any(p.min_p > 0.0 for p in params)
        self.min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]

    def _rows_where(self, flags: list[bool]) -> torch.Tensor | None:
        """Indices of the flagged rows; None when there are none."""
        return (
            torch.tensor([i for i, f in enumerate(flags) if f], dtype=torch.int64, device=self.device)
            if any(flags)
            else None
        )

    def _init_penalties(self, rows: list[SamplingRow], vocab_size: int) -> None:
        """Counts of each output token and the set of tokens seen (prompt and output), for penalized rows."""
        dev, params = self.device, [r.params for r in rows]
        self.repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
        self.frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
        self.presence = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
        self.counts = torch.zeros(self.size, vocab_size, device=dev)
        self.seen = torch.zeros(self.size, vocab_size, dtype=torch.bool, device=dev)
        which = [i for i, p in enumerate(params) if p.has_penalties]
        out_rows = torch.tensor([i for i in which for _ in rows[i].output_ids], dtype=torch.int64)
        out_ids = torch.tensor([t for i in which for t in rows[i].output_ids], dtype=torch.int64)
        self.counts.index_put_(
            (out_rows.to(dev), out_ids.to(dev)), torch.ones(len(out_ids), device=dev), accumulate=True
        )
        prompt_rows = torch.tensor([i for i in which for _ in rows[i].prompt_ids], dtype=torch.int64)
        prompt_ids = torch.tensor([t for i in which for t in rows[i].prompt_ids], dtype=torch.int64)
        self.seen[prompt_rows.to(dev), prompt_ids.to(dev)] = True
        self.seen |= self.counts > 0

    def advance(self, ids: torch.Tensor) -> None:
        """The rows just sampled `ids` (on the device): the next step's state."""
        self.steps += 1
        if self.penalized:
            self.counts[self.rows, ids] += 1
            self.seen[self.rows, ids] = True
