"""FlashInfer's top-k / top-p renormalizing kernels (the CUDA sampler's) against the torch path on the
same logits and uniforms: the same tokens for every kind of row, seeded, step after step (random logits:
no two probabilities tie at a threshold, where the two may keep different tokens)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer")

from common.engine.sampler import Sampler, flashinfer_sampling  # noqa: E402
from common.engine.sampling_batch import SamplingBatch, SamplingRow  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402

KINDS = [
    dict(temperature=0),
    dict(temperature=0.9, top_k=5),
    dict(temperature=1.1, top_p=0.7),
    dict(temperature=0.8, top_k=40, top_p=0.9),
    dict(temperature=1.0, min_p=0.02, top_p=0.95),
    dict(temperature=1.0),
]


def test_flashinfer_sampling_draws_the_torch_paths_tokens():
    kernels = flashinfer_sampling("cuda")
    assert kernels is not None
    torch.manual_seed(0)
    params = [SamplingParams(**kind, seed=i) for i, kind in enumerate(KINDS * 8)]
    rows = [SamplingRow(p, [1, 2], []) for p in params]
    batch = SamplingBatch(rows, 32000, "cuda")
    agree = total = 0
    for _ in range(20):
        logits = torch.randn(len(rows), 32000, device="cuda") * 4
        want = Sampler().sample(logits, batch).token_ids
        got = Sampler(kernels).sample(logits, batch).token_ids
        agree += sum(a == b for a, b in zip(got, want))
        total += len(want)
        batch.advance(torch.tensor(want, device="cuda"))
    assert agree == total, f"{total - agree} of {total} draws differ"
