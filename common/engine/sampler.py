"""Batched sampling: logit bias, a minimum of new tokens, penalties, greedy / temperature / top-k / top-p /
min-p, per-request seeds, logprobs.

Every row is handled by the same few tensor operations whatever its settings, and the results reach the
host in one transfer per batch. A token is drawn by inverse CDF from one uniform number per row: seeded
rows take it from their own SplitMix64 stream (the seed and how many tokens the request has sampled), so
a seeded request draws the same numbers alone, in any batch, after a retraction or across PD roles;
unseeded rows share torch's generator.

Logprobs are those of the raw model logits (before bias, masking, penalties, grammar and temperature), like
vLLM's default. A grammar's bitmask (common/engine/grammar/mask.py) comes last: it has the last word.

Top-k and top-p: on CUDA with FlashInfer, its renormalizing kernels (`top_k_renorm_probs`,
`top_p_renorm_probs`: threshold searches, no sort), as SGLang; elsewhere torch's topk and a sort, top-p a
chunk of rows at a time. Both keep the same tokens where no two probabilities tie at the threshold
(FlashInfer keeps every tied token), and the draw after them is this module's either way, so a seeded
request draws the same numbers on both. Memory: at most static_reserve.SAMPLER_ROW_FLOATS float32
[rows, vocab] tensors are alive at once (the caller's logits included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.sampling_batch import SamplingBatch

TOP_P_CHUNK_ROWS = 64


@dataclass
class SampleOutput:
    ids: torch.Tensor  # [B] int64 on the device: the next decode step's input
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def flashinfer_sampling(device: str):
    """FlashInfer's sampling kernels on CUDA (None elsewhere, or when it is not installed)."""
    if device != "cuda":
        return None
    try:
        import flashinfer.sampling
    except ImportError:
        return None
    return flashinfer.sampling


class Sampler:
    def __init__(self, kernels=None):
        """`kernels`: FlashInfer's sampling module (flashinfer_sampling), or None for torch's operations."""
        self.kernels = kernels

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.want_logprobs else None
        if batch.bias_rows is not None:
            logits = logits.index_put((batch.bias_rows, batch.bias_ids), batch.bias_values, accumulate=True)
        if batch.min_rows is not None:
            logits = mask_stop_tokens(logits, batch)
        if batch.penalized:
            logits = apply_penalties(logits, batch)
        if batch.grammar is not None:
            logits = batch.grammar.apply(logits)
        ids = logits.argmax(dim=-1)
        if not batch.all_greedy:
            ids = torch.where(
                batch.greedy, ids, draw(self.filtered_probs(logits / batch.temperature, batch), uniforms(batch))
            )
        return to_host(ids, raw_logprobs, batch)

    def filtered_probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if self.kernels is None:
            return filtered_probs(logits, batch)
        probs = torch.softmax(logits, dim=-1)
        if batch.top_k_rows is not None:  # rows that do not ask keep the whole vocabulary
            probs = self.kernels.top_k_renorm_probs(probs, batch.top_ks)
        if batch.top_p_rows is not None:
            probs = self.kernels.top_p_renorm_probs(probs, batch.top_ps)
        return min_p_filter(probs, batch)


def mask_stop_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """EOS and stop_token_ids at -inf in the rows that have sampled fewer than their min_new_tokens (SGLang's
    and vLLM's min tokens): they cannot end before it."""
    short = batch.steps[batch.min_rows] < batch.min_tokens
    kept = logits[batch.min_rows, batch.min_ids]
    return logits.index_put((batch.min_rows, batch.min_ids), torch.where(short, float("-inf"), kept))


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Softmax after each row's top-k, then its top-p and min-p (rows that do not ask keep everything)."""
    if batch.top_k_rows is not None:
        rows = logits[batch.top_k_rows]
        kth = rows.topk(batch.max_top_k, dim=-1).values.gather(1, batch.top_k_index)
        logits = logits.index_put((batch.top_k_rows,), rows.masked_fill(rows < kth, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    if batch.top_p_rows is not None:
        probs = probs.index_put((batch.top_p_rows,), top_p_in_chunks(probs[batch.top_p_rows], batch.top_p))
    return min_p_filter(probs, batch)


def min_p_filter(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.use_min_p:
        probs = probs.masked_fill(probs < batch.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def top_p_in_chunks(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_p_filter, TOP_P_CHUNK_ROWS rows at a time: its sort holds three [rows, vocab] float32s' worth of
    values and int64 indices, which for a whole batch would set the sampler's peak memory."""
    out = torch.empty_like(probs)
    for start in range(0, probs.shape[0], TOP_P_CHUNK_ROWS):
        rows = slice(start, start + TOP_P_CHUNK_ROWS)
        out[rows] = top_p_filter(probs[rows], top_p[rows])
    return out


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always the best one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the better tokens
    drop = before >= top_p
    drop[..., 0] = False  # a top_p below float32's smallest value rounds to 0 and would drop it too
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first token whose cumulative mass passes u * total (never a token of mass 0)."""
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0]
    return picked.clamp_(max=probs.shape[-1] - 1)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (Hugging Face's, over prompt and output), frequency and presence (OpenAI's, over output)."""
    penalized = torch.where(logits > 0, logits / batch.repetition, logits * batch.repetition)
    logits = torch.where(batch.seen, penalized, logits)
    return logits - batch.frequency * batch.counts - batch.presence * (batch.counts > 0).float()


# SplitMix64 (Steele et al.), in wrapping int64 arithmetic: the n-th number of the stream seeded s is
# mix(s + (n + 1) * GOLDEN).
GOLDEN, MIX1, MIX2 = (c - 2**64 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical shift (torch's >> is arithmetic on int64)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def seeded_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Number `counters` of each seed's stream, as a float32 in [0, 1) (its top 24 bits, exact)."""
    z = seeds + (counters + 1) * GOLDEN
    z = (z ^ _shift_right(z, 30)) * MIX1
    z = (z ^ _shift_right(z, 27)) * MIX2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 40).float() / 2**24


def uniforms(batch: SamplingBatch) -> torch.Tensor:
    u = torch.rand(batch.size, device=batch.device)
    if batch.any_seeded:
        u = torch.where(batch.seeded, seeded_uniforms(batch.seeds, batch.steps), u)
    return u


def to_host(ids: torch.Tensor, raw_logprobs: torch.Tensor | None, batch: SamplingBatch) -> SampleOutput:
    """Token ids, and the logprobs asked for, in a single device-to-host copy."""
    n = batch.size
    if raw_logprobs is None:
        return SampleOutput(ids, ids.tolist(), [None] * n, [None] * n)
    cols = [ids[:, None].double(), raw_logprobs.gather(1, ids[:, None]).double()]
    k = batch.max_top_logprobs
    if k:
        vals, idx = raw_logprobs.topk(k, dim=-1)
        cols += [idx.double(), vals.double()]  # float64 holds every token id exactly
    host = torch.cat(cols, dim=1).tolist()
    logprobs = [row[1] if want else None for row, want in zip(host, batch.return_logprob)]
    tops = [
        list(zip(map(int, row[2 : 2 + m]), row[2 + k : 2 + k + m])) if m else None
        for row, m in zip(host, batch.top_logprobs_num)
    ]
    return SampleOutput(ids, [int(row[0]) for row in host], logprobs, tops)
