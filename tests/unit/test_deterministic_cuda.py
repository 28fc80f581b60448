"""--enable-deterministic-inference's CUDA path, tested on the CPU behind the same seams (no GPU here; the GPU's
own check is tests/gpu/test_deterministic.py): the fixed-M tiling of products and row-wise reductions gives a row
the same bits alone and anywhere in a batch of any size, and every call of the op sees one shape; off the CPU
(a meta tensor stands for CUDA) `linear` and RMSNorm go through it; FlashInfer is planned with no KV split and
the tensor-core decode; a prefill forward holds one request on CUDA; what cannot hold is refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from common.attention.factory import make_attention_backend
from common.attention.flashinfer_backend import FlashInferAttention
from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.engine.prefill_queue import PrefillQueue
from common.memory.kv_pool import KVPool
from common.model.llama import RMSNorm
from common.parallel import invariant
from common.parallel.layers import ColumnParallelLinear, linear
from common.wire.sampling_params import SamplingParams
from tests.integration.tiny_model import random_prompts, save_tiny_llama
from tests.unit import fake_flashinfer

CUDA_FLAGS = {"device": "cuda", "enable_deterministic_inference": True, "disable_radix_cache": True}


@pytest.fixture(autouse=True)
def switch_off_after():
    yield
    invariant.enable(False)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 300), data=st.data())
def test_a_tiled_rows_bits_are_the_same_alone_and_anywhere_in_a_batch(m, data):
    """MKL's float32 F.linear changes a row's bits with M (invariant.py): in tiles, every M gives a row the
    bits it has alone, and the op only ever sees TILE_ROWS rows."""
    g = torch.Generator().manual_seed(m)
    weight, batch = torch.randn(576, 576, generator=g), torch.randn(m, 576, generator=g)
    seen = []

    def product(x):
        seen.append(x.shape[0])
        return F.linear(x, weight)

    at = data.draw(st.integers(0, m - 1))
    whole, alone = invariant.tiled(product, batch), invariant.tiled(product, batch[at : at + 1])
    assert torch.equal(whole[at], alone[0]) and whole.shape == (m, 576)
    assert set(seen) == {invariant.TILE_ROWS}
    assert torch.equal(whole, torch.cat([F.linear(t, weight) for t in tiles(batch)])[:m])


def tiles(x: torch.Tensor) -> list[torch.Tensor]:
    """x's rows in tiles of TILE_ROWS, the last padded with zero rows (what `tiled` computes, by hand)."""
    t = invariant.TILE_ROWS
    padded = torch.cat([x, x.new_zeros(-len(x) % t, *x.shape[1:])])
    return list(padded.split(t))


def test_a_row_wise_reduction_in_tiles_is_the_same_alone_and_in_a_batch():
    x = torch.randn(130, 7, 64)  # [tokens, heads, dim]: the q / k norms' shape
    mean = lambda t: t.pow(2).mean(-1, keepdim=True)  # noqa: E731
    tiled = invariant.tiled(mean, x)
    assert all(torch.equal(tiled[i], invariant.tiled(mean, x[i : i + 1])[0]) for i in (0, 63, 64, 129))


def test_off_the_cpu_every_product_and_norm_goes_through_tiles_and_on_the_cpu_nothing_changes(monkeypatch):
    """A meta tensor is a device that is not the CPU (CUDA's branch): the op sees TILE_ROWS rows per call."""
    calls = []
    real = invariant.tiled
    monkeypatch.setattr(invariant, "tiled", lambda op, x, *a: calls.append(x.shape[0]) or real(op, x, *a))
    invariant.enable(True)
    x, w = torch.empty(100, 32, device="meta"), torch.empty(16, 32, device="meta")
    assert linear(x, w).shape == (100, 16) and calls == [100]
    norm = RMSNorm(32, 1e-6).to("meta")
    assert norm(x).shape == (100, 32) and calls == [100, 100]
    cpu = torch.randn(5, 32)
    want = RMSNorm(32, 1e-6)(cpu)
    assert torch.equal(RMSNorm(32, 1e-6)(cpu), want) and calls == [100, 100]  # the CPU's paths: unchanged
    quantized = ColumnParallelLinear(32, 16, bias=False).to("meta")
    quantized.quant = Quantized()
    assert quantized(x).shape == (100, 16) and calls == [100, 100, 100]  # an FP8 / 4-bit layer's GEMM too
    assert set(quantized.quant.rows) == {invariant.TILE_ROWS}
    invariant.enable(False)
    assert linear(x, w).shape == (100, 16) and calls == [100, 100, 100]  # switch off: no tiles


class Quantized:
    """A quantized linear method's interface (common.quant.fp8_block.BlockFP8), recording the rows it is given."""

    scale_name = "weight"

    def __init__(self):
        self.rows = []

    def apply(self, x, weight, scale, bias):
        self.rows.append(len(x))
        return x @ weight.T


def pool() -> KVPool:
    return KVPool(2, 16, 4, 2, 64, torch.float32, "cpu")


def test_flashinfer_under_the_flag_plans_every_step_without_a_kv_split_on_tensor_core_decode(monkeypatch, tmp_path):
    fi = fake_flashinfer.install(monkeypatch)
    plain = make_attention_backend("flashinfer", "cuda", pool(), 2, 64, 0.125)  # 1 query head per KV head
    det = make_attention_backend("flashinfer", "cuda", pool(), 2, 64, 0.125, "fa2", True)
    use = [w.kwargs["use_tensor_cores"] for w in fi.BatchDecodeWithPagedKVCacheWrapper.calls]
    assert use == [False, True] and not plain.deterministic and det.deterministic
    engine = Engine(ServerConfig(model=str(save_tiny_llama(tmp_path, head_dim=64)), max_total_tokens=4096))
    a = engine.runner.attn
    attn = engine.runner.attn = FlashInferAttention(engine.kv_pool, a.num_q_heads, a.head_dim, a.scaling, "fa2", True)
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=3, temperature=0)) for i, p in enumerate(random_prompts(3, 5, 40))
    ]
    for r in reqs:
        engine.scheduler.add_request(r)
    while engine.scheduler.step():
        pass
    plans = attn.prefill.plans + attn.decode.plans
    assert attn.prefill.plans and attn.decode.plans and all(p.get("disable_split_kv") is True for p in plans)
    assert all(len(r.output_ids) == 3 for r in reqs)


def test_on_cuda_a_prefill_forward_holds_one_request(tmp_path):
    engine = Engine(ServerConfig(model=str(save_tiny_llama(tmp_path)), max_total_tokens=4096))
    queue = PrefillQueue(ServerConfig(**CUDA_FLAGS), engine.memory)
    for i, p in enumerate(random_prompts(3, 5, 20)):
        queue.add(Req(f"r{i}", p, SamplingParams(max_new_tokens=1)))
    assert [len(queue.schedule(8, True).reqs) for _ in range(3)] == [1, 1, 1]
    assert PrefillQueue(engine.config, engine.memory).per_forward > 8  # the CPU: batches as before


def test_the_torch_backend_on_cuda_is_refused_under_the_flag_in_one_line():
    with pytest.raises(ValueError) as e:
        make_attention_backend("torch", "cuda", pool(), 4, 64, 0.125, "fa2", True)
    assert (
        len(str(e.value).splitlines()) == 1 and "FlashInfer" in str(e.value) and "MHA pool of float32" in str(e.value)
    )


@pytest.mark.parametrize(
    "flags, names",
    [
        ({"device": "cuda"}, "the prefix cache on CUDA"),
        (CUDA_FLAGS | {"attention_backend": "torch"}, "--device cuda --attention-backend torch"),
        (CUDA_FLAGS | {"speculative_algorithm": "NGRAM"}, "--speculative-algorithm on CUDA"),
        (CUDA_FLAGS | {"tp_size": 4}, "--tp-size 4"),
    ],
)
def test_what_cuda_cannot_hold_is_refused_at_start_up_in_one_line(flags, names):
    with pytest.raises(ValueError) as e:
        ServerConfig(**({"enable_deterministic_inference": True} | flags))
    message = str(e.value).splitlines()[1]
    assert names in message and "drop --enable-deterministic-inference" in message


def test_what_cuda_holds_starts():
    assert ServerConfig(**CUDA_FLAGS).enable_deterministic_inference
    assert ServerConfig(**CUDA_FLAGS, attention_backend="flashinfer", tp_size=2).tp_size == 2
