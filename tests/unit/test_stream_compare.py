"""The migration drill's comparison (benchmarks/stream_compare.py): a seeded draw re-drawn from a request's top-k
logprobs is the token the sampler drew, and a parting is called a float near-tie only when it is one."""

from __future__ import annotations

import torch

from benchmarks.stream_compare import parting, seeded_draw
from common.engine.sampler import Sampler
from common.engine.sampling_batch import SamplingBatch, SamplingRow
from common.wire.sampling_params import SamplingParams

VOCAB, TOP_K, T = 512, 20, 0.9


def sampled(logits: torch.Tensor, seed: int, step: int) -> tuple[int, list]:
    """The sampler's token and top-k logprobs (as /generate returns them) for one seeded row at `step`."""
    params = SamplingParams(temperature=T, top_k=TOP_K, seed=seed, max_new_tokens=64)
    row = SamplingRow(params, [1], [7] * step, top_logprobs_num=TOP_K, return_logprob=True)
    out = Sampler().sample(logits[None], SamplingBatch([row], VOCAB, "cpu"))
    return out.token_ids[0], [[lp, t, None] for t, lp in out.top_logprobs[0]]


def test_a_seeded_draw_redrawn_from_the_top_k_logprobs_is_the_samplers():
    for trial in range(200):
        logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
        token, top = sampled(logits, 1000 + trial, trial % 48)
        assert seeded_draw(top, 1000 + trial, trial % 48, T)[0] == token


def answer(ids: list[int], tops: list[list]) -> dict:
    lps = [[next(lp for lp, t, _ in top if t == i), i, None] for i, top in zip(ids, tops)]
    return {"status": 200, "error": None, "answer": (ids, "", lps), "top": tops}


def test_a_parting_is_a_near_tie_only_within_float_noise():
    greedy = {"sampling_params": {"temperature": 0}}
    tops = [[[-0.1, 5, None], [-3.0, 6, None]], [[-0.69310, 8, None], [-0.69315, 9, None]]]
    swapped = [tops[0], [[-0.69312, 9, None], [-0.69314, 8, None]]]
    tie = parting(greedy, answer([5, 8], tops), answer([5, 9], swapped))
    assert tie["first differing token"] == 1 and tie["near_tie"]
    wide = [tops[0], [[-0.5, 8, None], [-0.9, 9, None]]]
    assert not parting(greedy, answer([5, 8], wide), answer([5, 9], [tops[0], [[-0.5, 9, None], [-0.9, 8, None]]]))[
        "near_tie"
    ]
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    token, top = sampled(logits, 1000, 0)
    seeded = {"sampling_params": {"temperature": T, "top_k": TOP_K, "seed": 1000}}
    other = next(t for _, t, _ in top if t != token)  # not what the logprobs draw: no near-tie explains it
    assert not parting(seeded, answer([token], [top]), answer([other], [top]))["near_tie"]
