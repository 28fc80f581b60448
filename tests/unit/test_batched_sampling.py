"""The batched sampler: each row keeps to its own settings in a mixed batch, draws follow the
probabilities, seeded rows follow their own SplitMix64 stream, and the state a decode batch keeps
across steps equals one rebuilt from the requests."""

from __future__ import annotations

import pytest
import torch

from common.engine.sampler import Sampler, apply_penalties, seeded_uniforms
from common.engine.sampling_batch import SamplingBatch, SamplingRow
from common.wire.sampling_params import SamplingParams

MASK = 2**64 - 1


def splitmix64(seed: int, n: int) -> float:
    """The reference: the n-th number of SplitMix64 seeded `seed`, top 24 bits as a fraction."""
    z = (seed + (n + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    z ^= z >> 31
    return (z >> 40) / 2**24


def rows(*params: dict, output=(), stop_ids=frozenset()) -> list[SamplingRow]:
    return [SamplingRow(SamplingParams(**p), [1, 2], list(output), stop_ids=frozenset(stop_ids)) for p in params]


def test_seeded_uniforms_are_splitmix64_in_wrapping_int64():
    seeds = [0, 1, 42, -1, -(2**63), 2**63 - 1, 123456789123456789]
    counters = [0, 1, 7, 1000, 2**40, 5, 3]
    got = seeded_uniforms(torch.tensor(seeds), torch.tensor(counters)).tolist()
    assert got == [splitmix64(s & MASK, n) for s, n in zip(seeds, counters)]


def test_each_row_keeps_to_its_own_filters_in_one_mixed_batch():
    torch.manual_seed(0)
    probs = torch.tensor([0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02])
    logits = probs.log().repeat(5, 1)
    settings = [dict(temperature=0), dict(top_k=2), dict(top_p=0.6), dict(min_p=0.3), dict(temperature=1.0)]
    allowed = [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, set(range(8))]  # top_p 0.6: 0.30 + 0.25 < 0.6 needs token 2
    seen: list[set[int]] = [set() for _ in settings]
    for seed in range(300):
        batch = SamplingBatch(rows(*[dict(s, seed=seed) for s in settings]), 8, "cpu")
        for i, token in enumerate(Sampler().sample(logits, batch).token_ids):
            seen[i].add(token)
    assert seen[:4] == allowed[:4]
    assert len(seen[4]) >= 6  # plain sampling reaches the tail too


@pytest.mark.parametrize("seeded", [False, True])
def test_draws_follow_the_probabilities(seeded):
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 8000
    params = [dict(temperature=1.0, seed=s if seeded else None) for s in range(n)]
    ids = Sampler().sample(probs.log().repeat(n, 1), SamplingBatch(rows(*params), 4, "cpu")).ids
    freq = torch.bincount(ids, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.02), freq


def test_a_kept_batch_advanced_in_place_equals_one_rebuilt_from_the_requests():
    torch.manual_seed(0)
    vocab = 50
    params = [
        dict(temperature=0.9, seed=7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        dict(temperature=1.1, top_k=10, seed=-3),
        dict(temperature=0.8, top_p=0.8),
    ]
    outputs: list[list[int]] = [[], [], []]
    kept = SamplingBatch(rows(*params), vocab, "cpu")
    for _ in range(6):
        logits = torch.randn(3, vocab)
        rebuilt = SamplingBatch(
            [SamplingRow(SamplingParams(**p), [1, 2], list(o)) for p, o in zip(params, outputs)], vocab, "cpu"
        )
        assert torch.equal(kept.steps, rebuilt.steps)
        assert torch.equal(apply_penalties(logits, kept), apply_penalties(logits, rebuilt))
        out = Sampler().sample(logits, kept)
        assert out.token_ids[:2] == Sampler().sample(logits, rebuilt).token_ids[:2]  # the seeded rows
        kept.advance(out.ids)
        for o, t in zip(outputs, out.token_ids):
            o.append(t)


def test_logit_bias_moves_greedy_and_sampled_rows_but_not_their_neighbours_or_logprobs():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]]).repeat(3, 1)
    params = [
        dict(temperature=0, logit_bias={"1": -100}),
        dict(temperature=0),
        dict(temperature=1.0, seed=5, logit_bias={"3": 100}),
    ]
    batch = SamplingBatch([SamplingRow(SamplingParams(**p), [1], [], return_logprob=True) for p in params], 4, "cpu")
    out = Sampler().sample(logits, batch)
    assert out.token_ids == [2, 1, 3]
    assert out.logprobs == [pytest.approx(torch.log_softmax(logits[0], -1)[t].item()) for t in (2, 1, 3)]  # raw


def test_a_batch_without_bias_or_minimum_has_no_tensors_for_them():
    batch = SamplingBatch(rows(dict(temperature=0), dict(min_new_tokens=2), stop_ids={0}, output=[5, 6]), 4, "cpu")
    assert batch.bias_rows is None and batch.min_rows is None  # row 2 already has its 2 tokens


def test_stop_tokens_are_masked_until_min_new_tokens_then_sampled_again():
    logits = torch.tensor([[5.0, 0.0, 1.0, 0.5]]).repeat(2, 1)  # token 0 (the stop token) is the best
    params = [dict(temperature=0, min_new_tokens=2, max_new_tokens=8), dict(temperature=0)]
    kept = SamplingBatch(rows(*params, stop_ids={0}), 4, "cpu")
    picked = []
    for _ in range(3):
        out = Sampler().sample(logits, kept)
        picked.append(out.token_ids)
        kept.advance(out.ids)
    assert picked == [[2, 0], [2, 0], [0, 0]]  # row 1 asks no minimum: never masked


def test_min_new_tokens_masks_every_stop_token_of_a_sampled_row():
    logits = torch.tensor([[3.0, 3.0, 0.0, 3.0]]).repeat(500, 1)
    params = [dict(temperature=1.0, seed=s, min_new_tokens=1, max_new_tokens=4) for s in range(500)]
    ids = Sampler().sample(logits, SamplingBatch(rows(*params, stop_ids={0, 3}), 4, "cpu")).token_ids
    assert set(ids) == {1, 2}


class ReferenceKernels:
    """FlashInfer's top_k_renorm_probs / top_p_renorm_probs as their documentation defines them (keep
    the probabilities at or above the k-th largest; keep those at or above the threshold whose kept mass
    reaches top_p; renormalize), for checking what the CUDA path hands them."""

    @staticmethod
    def top_k_renorm_probs(probs, top_k):
        assert top_k.dtype == torch.int32 and top_k.shape == probs.shape[:1]
        kth = probs.sort(dim=-1, descending=True).values.gather(
            1, (top_k.long() - 1).clamp(max=probs.shape[1] - 1)[:, None]
        )
        kept = probs.masked_fill(probs < kth, 0.0)
        return kept / kept.sum(-1, keepdim=True)

    @staticmethod
    def top_p_renorm_probs(probs, top_p):
        assert top_p.dtype == torch.float32 and top_p.shape == probs.shape[:1]
        values = probs.sort(dim=-1, descending=True).values
        before = values.cumsum(-1) - values
        threshold = values.masked_fill(before >= top_p[:, None], 2.0).min(-1, keepdim=True).values
        kept = probs.masked_fill(probs < threshold, 0.0)
        return kept / kept.sum(-1, keepdim=True)


def test_flashinfers_renorm_kernels_draw_what_the_torch_path_draws():
    """Mixed rows (greedy, top-k, top-p, both, min-p, none), seeded: the CUDA path's per-row settings
    (the whole vocabulary and 1.0 where a row does not ask) give the same tokens, step after step."""
    torch.manual_seed(0)
    kinds = [
        dict(temperature=0),
        dict(temperature=0.9, top_k=5),
        dict(temperature=1.1, top_p=0.7),
        dict(temperature=0.8, top_k=40, top_p=0.9),
        dict(temperature=1.0, min_p=0.02, top_p=0.95),
        dict(temperature=1.0),
    ]
    params = [dict(kind, seed=i) for i, kind in enumerate(kinds * 4)]
    batch = SamplingBatch(rows(*params), 300, "cpu")
    assert batch.top_ks.tolist()[:4] == [300, 5, 300, 40] and batch.top_ps.tolist()[:4] == pytest.approx(
        [1, 1, 0.7, 0.9]
    )
    for _ in range(5):
        logits = torch.randn(len(params), 300) * 3
        torch_ids = Sampler().sample(logits, batch).token_ids
        assert Sampler(ReferenceKernels()).sample(logits, batch).token_ids == torch_ids
        batch.advance(torch.tensor(torch_ids))


def test_the_sampler_holds_at_most_sampler_row_floats_rows_of_the_vocabulary():
    """Every filter on every row of 512 (logit bias, min tokens, penalties, top-k, top-p, min-p, logprobs):
    the float32 [rows, vocab] tensors alive at once, the caller's logits counted, stay within what the
    KV sizing sets aside per running request (static_reserve.SAMPLER_ROW_FLOATS)."""
    from common.memory.static_reserve import SAMPLER_ROW_FLOATS

    n, vocab = 512, 32000
    every = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.1)
    rows_ = [
        SamplingRow(SamplingParams(**every, seed=i, logit_bias={"3": 1.0}, min_new_tokens=2), [1, 2], [4], 2, True, {7})
        for i in range(n)
    ]
    batch, logits = SamplingBatch(rows_, vocab, "cpu"), torch.randn(n, vocab)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        Sampler().sample(logits, batch)
    live = peak = 0
    for _, change in sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()):
        live += change
        peak = max(peak, live)
    assert 1 + peak / (n * vocab * 4) <= SAMPLER_ROW_FLOATS
