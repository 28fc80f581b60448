"""The prefix cache never holds KV that was not computed: a real model (tiny, in process) whose forward
dies half way through a prompt's second chunk, after its first layer wrote that chunk's KV and before
the second did (as a CUDA out-of-memory error would). A later request with the same prompt must reuse
only the first chunk and get exactly the tokens a fresh server gives."""

from __future__ import annotations

import pytest

from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.wire.sampling_params import SamplingParams
from tests.integration.tiny_model import random_prompts

PROMPT = random_prompts(1, 60, 60, seed=5)[0]  # 15 pages of 4 tokens, chunks of 16


def engine(model_dir) -> Engine:
    """An engine whose scheduler the test steps itself (no thread)."""
    return Engine(ServerConfig(model=str(model_dir), page_size=4, chunked_prefill_size=16, max_total_tokens=2048))


def generate(e: Engine, rid: str) -> Req:
    req = Req(rid, PROMPT, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    e.scheduler.add_request(req)
    while not req.finished:
        e.scheduler.step()
    return req


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[int]:
    return generate(engine(tiny_model_dir), "fresh").output_ids


def test_a_forward_that_dies_mid_chunk_leaves_only_computed_kv_in_the_cache(tiny_model_dir, reference):
    e = engine(tiny_model_dir)
    layer = e.runner.model.model.layers[1]
    real_forward, calls = layer.forward, []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second chunk: layer 0 already wrote its KV, this layer never will
            raise RuntimeError("CUDA out of memory")
        return real_forward(*args, **kwargs)

    layer.forward = forward
    failed = generate(e, "fails")
    assert failed.finish.status == 500 and "CUDA out of memory" in failed.finish.message
    assert len(e.memory.prefix_cache.match_prefix(PROMPT).slots) == 16  # the first chunk only
    again = generate(e, "again")
    assert again.prefix_hit_len == 16 and again.output_ids == reference
    counts = e.scheduler.check_integrity()
    assert counts.owned == counts.locked == 0
