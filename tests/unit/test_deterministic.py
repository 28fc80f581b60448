"""--enable-deterministic-inference at the op and engine level (Hypothesis draws the batches): a row of the
products is the same bits alone and at any place in a batch of any size; a token's attention is the same
bits computed in a prefill chunk of any size or in a decode step; and the engine's tokens and logprobs for
a request (greedy and seeded) are the same bits alone and among other requests, at any chunk size, from
the prefix cache, with an FP8 cache. Without the flag the same batches change them (the test can fail)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.attention.fixed_split import SPLIT, split_attention, split_kv
from common.config import ServerConfig
from common.core.attention_spec import AttentionSpec
from common.core.request import Req
from common.engine.engine import Engine
from common.memory.pool_factory import make_kv_pool
from common.parallel import invariant
from common.parallel.layers import linear
from common.wire.kv_layout import kv_layout, layout_mismatch
from common.wire.sampling_params import SamplingParams
from tests.integration.tiny_model import VOCAB, random_prompts, save_tiny_llama

SHAPES = [(64, 576), (1536, 576), (576, 1536), (128, 64)]  # (out, in): the built-in model's and the tiny one's
TARGETS = random_prompts(4, 5, 300, seed=7)  # one crosses a split of SPLIT keys
NEW = 12


@pytest.fixture(autouse=True)
def switch_off_after():
    yield
    invariant.enable(False)  # a process-wide switch: no other test runs with it


@settings(max_examples=30, deadline=None)
@given(shape=st.sampled_from(SHAPES), m=st.integers(1, 600), data=st.data())
def test_a_row_of_a_product_is_the_same_alone_and_anywhere_in_a_batch(shape, m, data):
    invariant.enable(True)
    g = torch.Generator().manual_seed(m)
    weight, batch = torch.randn(*shape, generator=g), torch.randn(m, shape[1], generator=g)
    at = data.draw(st.integers(0, m - 1))
    assert torch.equal(linear(batch, weight)[at], linear(batch[at : at + 1], weight)[0])


@settings(max_examples=12, deadline=None)
@given(chunk=st.integers(1, 40), start=st.integers(0, 2 * SPLIT), heads=st.sampled_from([(3, 3), (2, 1), (1, 1)]))
def test_a_tokens_attention_is_the_same_in_a_prefill_chunk_and_in_a_decode_step(chunk, start, heads):
    """Queries [start, start + chunk) of one request as a prefill chunk, against each as its own decode
    step (with the request padded to a longer table, as in a batch of longer requests); head_dim 64."""
    hkv, group = heads
    g = torch.Generator().manual_seed(chunk * 1000 + start)
    s = -(-(start + chunk) // SPLIT) * SPLIT
    k, v = torch.randn(1, s + SPLIT, hkv, 64, generator=g), torch.randn(1, s + SPLIT, hkv, 64, generator=g)
    q = torch.randn(1, hkv, group, chunk, 64, generator=g)
    pos = torch.arange(start, start + chunk).repeat(group)[None, None, :, None]
    prefill = split_attention(q.reshape(1, hkv, -1, 64), *split_kv(k[:, :s], v[:, :s]), pos)
    prefill = prefill.view(1, hkv, group, chunk, 64)
    keys, vals = split_kv(k, v)
    for e in range(chunk):
        one = split_attention(q[:, :, :, e].contiguous(), keys, vals, torch.full((1, 1, group, 1), start + e))
        assert torch.equal(one, prefill[:, :, :, e])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-det"), head_dim=64)  # the kernels of real head sizes


def target(i: int) -> Req:
    """The requests whose answers must not change: greedy and seeded, logprobs on."""
    seeded = dict(temperature=0.8, seed=100 + i) if i % 2 else dict(temperature=0)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, **seeded)
    return Req(f"t{i}", TARGETS[i], params, return_logprob=True, top_logprobs_num=2)


def answer(req: Req) -> tuple:
    return req.output_ids, req.output_logprobs, req.output_top_logprobs


def run(engine: Engine, reqs: list[Req]) -> None:
    for req in reqs:
        engine.scheduler.add_request(req)
    for _ in range(10_000):
        if all(r.finished for r in reqs):
            return
        engine.scheduler.step()
    raise AssertionError("the requests did not finish")


class Engines:
    """One engine per (flags): built once for the module, reused by every example (its prefix cache too)."""

    def __init__(self, model_dir):
        self.model_dir, self.built = model_dir, {}

    def get(self, **flags) -> Engine:
        key = tuple(sorted(flags.items()))
        if key not in self.built:
            config = dict(model=str(self.model_dir), max_total_tokens=16384, max_running_requests=48, **flags)
            self.built[key] = Engine(ServerConfig(**config))
        invariant.enable(flags.get("enable_deterministic_inference", False))  # the engine of this example's
        return self.built[key]


@pytest.fixture(scope="module")
def engines(model_dir):
    return Engines(model_dir)


@pytest.fixture(scope="module")
def alone(engines):
    """Each target alone, on a fresh engine (nothing cached), one chunk."""
    engine = Engine(ServerConfig(model=str(engines.model_dir), enable_deterministic_inference=True))
    out = []
    for i in range(len(TARGETS)):
        req = target(i)
        run(engine, [req])
        out.append(answer(req))
    return out


def crowd(rng: random.Random, others: int) -> list[Req]:
    """Other requests around the targets: random lengths and lengths of output, some sampled unseeded."""
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 160))] for _ in range(others)]
    temps = [rng.choice([0.0, 1.0]) for _ in prompts]
    return [
        Req(f"o{rng.random()}", p, SamplingParams(max_new_tokens=rng.randint(1, 20), temperature=t, ignore_eos=True))
        for p, t in zip(prompts, temps)
    ]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    others=st.integers(0, 12),
    seed=st.integers(0, 2**31),
    chunk=st.sampled_from([32, 64, 4096]),
    kv=st.sampled_from(["auto", "fp8_e4m3"]),
    spec=st.sampled_from([{}, {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}]),
)
def test_a_requests_answer_is_the_same_alone_and_in_any_batch(engines, alone, others, seed, chunk, kv, spec):
    """Among `others` requests, in a random order, prompts in chunks of `chunk` tokens, later ones often
    partly from the prefix cache (the engine serves every example), with and without NGRAM speculation."""
    rng = random.Random(seed)
    flags = dict(chunked_prefill_size=chunk, kv_cache_dtype=kv, **spec)
    engine = engines.get(enable_deterministic_inference=True, **flags)
    reqs = crowd(rng, others)
    targets = [target(i) for i in range(len(TARGETS))]
    for t in targets:
        reqs.insert(rng.randint(0, len(reqs)), t)
    run(engine, reqs)
    want = alone if kv == "auto" else fp8_alone(engines)
    assert [answer(t) for t in targets] == want


def fp8_alone(engines) -> list[tuple]:
    """The targets alone on an FP8 cache (its rounding changes the answer, never with the batch)."""
    if "fp8" not in engines.built:
        engine = Engine(
            ServerConfig(model=str(engines.model_dir), enable_deterministic_inference=True, kv_cache_dtype="fp8_e4m3")
        )
        engines.built["fp8"] = []
        for i in range(len(TARGETS)):
            req = target(i)
            run(engine, [req])
            engines.built["fp8"].append(answer(req))
    invariant.enable(True)
    return engines.built["fp8"]


def test_without_the_flag_the_same_batch_changes_the_answer(engines):
    """The control: the products and SDPA of the default path change a row's bits with its batch."""
    engine = engines.get(enable_deterministic_inference=False)
    lone = Engine(ServerConfig(model=str(engines.model_dir)))
    first = target(0)
    run(lone, [first])
    reqs = crowd(random.Random(3), 16)
    again = target(0)
    reqs.insert(5, again)
    run(engine, reqs)
    assert first.output_logprobs != again.output_logprobs


def test_a_deterministic_decode_refuses_a_prefill_that_is_not():
    pool = make_kv_pool(AttentionSpec("mha", 2, 4, 1, 40, 40, 0.1), 3, 4, torch.float32, torch.float32, "cpu")
    decode, prefill = kv_layout(pool, "mooncake", "m", deterministic=True), kv_layout(pool, "mooncake", "m")
    assert "deterministic: decode has True, prefill has False" in layout_mismatch(decode, prefill)
    assert layout_mismatch(decode, dict(decode)) is None
    assert layout_mismatch(prefill, {k: v for k, v in prefill.items() if k != "deterministic"}) is None  # older


@pytest.mark.parametrize(
    "flags, names",
    [
        ({"device": "cuda", "disable_radix_cache": True, "attention_backend": "torch"}, "--device cuda"),
        ({"tp_size": 4}, "--tp-size 4"),
        ({"enable_lora": True, "lora_paths": ["a=/x"]}, "--enable-lora"),
    ],
)
def test_what_the_flag_cannot_hold_is_refused_at_start_up_in_one_line(flags, names):
    with pytest.raises(ValueError) as e:
        ServerConfig(enable_deterministic_inference=True, **flags)
    message = str(e.value).splitlines()[1]
    assert names in message and "drop --enable-deterministic-inference" in message
