"""The decode hot path on a real engine (tiny model): one scheduler step does the same tensor work at
batch 4 and batch 24 (no operation per request) and reads one thing back from its tensors, the sampled
tokens (with their logprobs), in one copy: every length and page count comes from the host; a seeded
request draws the same tokens alone or in a batch that changes around it."""

from __future__ import annotations

from collections import Counter

import pytest
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.wire.sampling_params import SamplingParams
from tests.integration.tiny_model import random_prompts

KINDS = [
    dict(temperature=0),
    dict(temperature=0.8, top_k=20, seed=5),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1),
]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class ScalarReads(TorchFunctionMode):
    """Every read of a tensor's values into Python: tolist/item/numpy and int()/float()/bool()/index
    (on CUDA each one waits for the device)."""

    READS = {"tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def steady_engine(model_dir, batch: int) -> Engine:
    engine = Engine(ServerConfig(model=str(model_dir), max_running_requests=batch, max_total_tokens=8192))
    for i, p in enumerate(random_prompts(batch, 20, 40)):
        params = SamplingParams(max_new_tokens=100, ignore_eos=True, **KINDS[i % len(KINDS)])
        engine.scheduler.add_request(Req(f"r{i}", p, params, return_logprob=i % 3 == 0, top_logprobs_num=2))
    while len(engine.scheduler.decode.running) < batch:
        engine.scheduler.step()
    engine.scheduler.step()  # the first decode step builds the kept batch
    return engine


def count_one_step(engine: Engine) -> tuple[Counter, list[str]]:
    with ScalarReads() as reads, OpCounter() as counter:
        assert engine.scheduler.step()
    return counter.ops, reads.reads


def test_a_decode_step_does_the_same_tensor_work_at_any_batch_size(tiny_model_dir):
    small, big = steady_engine(tiny_model_dir, 4), steady_engine(tiny_model_dir, 24)
    ops_small, reads_small = count_one_step(small)
    ops_big, reads_big = count_one_step(big)
    assert ops_small == ops_big
    assert reads_small == reads_big == ["tolist"]  # the sampled tokens and logprobs, in one copy


def test_a_decode_step_of_16_reads_only_the_sampled_tokens_back(tiny_model_dir):
    """Page-table metadata, positions and new slots are built from host-side lengths and sent in one copy:
    steps that open new pages (every 16th token) and steps that do not read back one thing each."""
    engine = steady_engine(tiny_model_dir, 16)
    for _ in range(20):
        ops, reads = count_one_step(engine)
        assert ops["aten._local_scalar_dense"] + len(reads) <= 1, reads


@pytest.mark.parametrize("kind", [1, 3])  # seeded top-k; seeded with penalties
def test_a_seeded_request_draws_the_same_tokens_alone_or_in_a_changing_batch(tiny_model_dir, kind):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **(KINDS[kind] | {"seed": 11}))
    prompt, *others = random_prompts(6, 20, 40, seed=3)

    def run(neighbours: list[list[int]]) -> list[int]:
        engine = Engine(ServerConfig(model=str(tiny_model_dir), max_total_tokens=8192))
        s = engine.scheduler
        target = Req("target", prompt, params)
        s.add_request(target)
        for step, p in enumerate(neighbours):  # neighbours join one by one and finish at different times
            s.step()
            s.add_request(Req(f"n{step}", p, SamplingParams(max_new_tokens=3 + 4 * step, **KINDS[step % 4])))
        while s.step():
            pass
        return target.output_ids

    assert run(others) == run([])
