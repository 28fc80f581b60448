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


def rows(*params: dict, output=()) -> list[SamplingRow]:
    return [SamplingRow(SamplingParams(**p), [1, 2], list(output)) for p in params]


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
    params = [dict(temperature=0.9, seed=7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
              dict(temperature=1.1, top_k=10, seed=-3), dict(temperature=0.8, top_p=0.8)]
    outputs: list[list[int]] = [[], [], []]
    kept = SamplingBatch(rows(*params), vocab, "cpu")
    for _ in range(6):
        logits = torch.randn(3, vocab)
        rebuilt = SamplingBatch([SamplingRow(SamplingParams(**p), [1, 2], list(o)) for p, o in zip(params, outputs)], vocab, "cpu")
        assert torch.equal(kept.steps, rebuilt.steps)
        assert torch.equal(apply_penalties(logits, kept), apply_penalties(logits, rebuilt))
        out = Sampler().sample(logits, kept)
        assert out.token_ids[:2] == Sampler().sample(logits, rebuilt).token_ids[:2]  # the seeded rows
        kept.advance(out.ids)
        for o, t in zip(outputs, out.token_ids):
            o.append(t)
