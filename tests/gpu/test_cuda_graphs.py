"""Decode steps replayed from CUDA graphs on a GPU: captured at warm-up, greedy tokens and logprobs
equal to eager decoding (--disable-cuda-graph) over batches that cross bucket sizes, speculative verify
steps replayed from theirs equal too, a step reads back
only its sampled tokens, and the memory the graphs took is within what the pool's sizing set aside."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer")

from common.config import ServerConfig  # noqa: E402
from common.core.request import Req  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402
from tests.integration.tiny_model import random_prompts, save_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-hd64-graphs"), head_dim=64)


def generate(model_dir, **flags) -> tuple[Engine, list[Req]]:
    config = ServerConfig(
        model=str(model_dir), device="cuda", dtype="bfloat16", max_running_requests=24, max_total_tokens=16384,
        cuda_graph_max_bs=16, **flags,
    )  # fmt: skip
    engine = Engine(config)
    engine.warm_up()
    if engine.scheduler.decode.spec is not None:  # NGRAM: the same drafts with graphs and without (eager: as
        engine.scheduler.decode.spec.pad_drafts = True  # capture_graphs sets it), so the same verify steps
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=24 + i, temperature=0, ignore_eos=True), return_logprob=True)
        for i, p in enumerate(random_prompts(20, 5, 60))
    ]
    for r in reqs:
        engine.scheduler.add_request(r)
    while engine.scheduler.step():
        pass
    return engine, reqs


def test_graphs_decode_what_eager_steps_decode(model_dir):
    graphed, got = generate(model_dir)
    assert [(g.tokens, g.max_bs) for g in graphed.runner.graphs] == [(1, 16)]
    eager, want = generate(model_dir, disable_cuda_graph=True)
    assert eager.runner.graphs == []
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    for a, b in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 2e-2
    assert graphed.memory.check_integrity().free == eager.memory.check_integrity().free


def test_verify_graphs_verify_what_eager_steps_verify(model_dir):
    """NGRAM on the tiny model's prompts: its verify steps of k + 1 = 4 tokens per request replay graphs."""
    spec = {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3}
    graphed, got = generate(model_dir, **spec)
    assert [(g.tokens, g.max_bs) for g in graphed.runner.graphs] == [(4, 16), (1, 16)]
    eager, want = generate(model_dir, disable_cuda_graph=True, **spec)
    assert eager.runner.graphs == []
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.spec_verify_ct for r in got] == [r.spec_verify_ct for r in want] and sum(r.spec_verify_ct for r in got)
    for a, b in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 2e-2
    assert graphed.memory.check_integrity().free == eager.memory.check_integrity().free
