"""Batched sampling: penalties, greedy / temperature / top-k / top-p / min-p, per-request seeds, logprobs.

Logprobs are those of the raw model logits (before penalties and temperature), like vLLM's default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.wire.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    top_logprobs_num: int = 0
    return_logprob: bool = False


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def make_generator(seed: int | None, device: str) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class Sampler:
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
        logits = logits.float()
        want_logprobs = any(r.return_logprob for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if all(r.params.is_greedy and not r.params.has_penalties for r in rows):
            ids = logits.argmax(dim=-1).tolist()
        else:
            ids = [self._sample_row(logits[i], r) for i, r in enumerate(rows)]
        logprobs: list[float | None] = [None] * len(rows)
        tops: list[list[tuple[int, float]] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                if not r.return_logprob:
                    continue
                logprobs[i] = float(raw_logprobs[i, ids[i]])
                if r.top_logprobs_num > 0:
                    vals, idx = raw_logprobs[i].topk(r.top_logprobs_num)
                    tops[i] = list(zip(idx.tolist(), vals.tolist()))
        return SampleOutput(ids, logprobs, tops)

    def _sample_row(self, logits: torch.Tensor, row: SamplingRow) -> int:
        p = row.params
        if p.has_penalties:
            logits = apply_penalties(logits.clone(), row)
        if p.is_greedy:
            return int(logits.argmax())
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = logits.topk(p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            probs = top_p_filter(probs, p.top_p)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=row.generator))


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always the best one)."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the better tokens
    drop = before >= top_p
    drop[..., 0] = False  # a top_p below float32's smallest value rounds to 0 and would drop it too
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.int64, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if row.output_ids and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
        out = torch.tensor(row.output_ids, dtype=torch.int64, device=logits.device)
        counts = torch.zeros_like(logits).scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits
