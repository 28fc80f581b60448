"""DeepSeek's FP8 blocks on a GPU: torch's block-scaled GEMM (common.quant.fp8_gemm) is found by its probe on
Hopper, agrees with the dequantized product, and a tiny FP8 Llama in 128x128 blocks serves through it
(every quantized layer's product taken by the GEMM) with greedy tokens equal to the dequantizing path's
except at a reported near-tie (the activations' FP8 rounding)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from common.config import ServerConfig  # noqa: E402
from common.core.request import Req  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.quant import fp8_gemm  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402
from tests.integration.fp8_models import dequantize_block, quantize_block, to_fp8_block  # noqa: E402
from tests.integration.test_architectures import save_tiny  # noqa: E402
from tests.integration.tiny_model import random_prompts  # noqa: E402

HOPPER = torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not HOPPER, reason="torch's block-scaled FP8 GEMM needs compute capability 9.0")
def test_the_probe_finds_the_gemm_and_it_agrees_with_the_dequantized_product():
    assert fp8_gemm.available()
    w = torch.randn(512, 384)
    q, scale = quantize_block(w, (128, 128))
    x = torch.randn(7, 384, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ dequantize_block(q, scale, (128, 128)).cuda().t()
    got = fp8_gemm.block_scaled_mm(x, q.cuda(), scale.cuda(), None).float()
    assert (got - want).norm() / want.norm() < 0.03


def generate(model_dir, prompts) -> list[list[int]]:
    config = ServerConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_total_tokens=8192)
    engine = Engine(config)
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.scheduler.add_request(r)
    while engine.scheduler.step():
        pass
    return [r.output_ids for r in reqs]


@pytest.mark.skipif(not HOPPER, reason="torch's block-scaled FP8 GEMM needs compute capability 9.0")
def test_a_128_block_checkpoint_serves_through_the_gemm(tmp_path, monkeypatch):
    src = tmp_path / "src"  # every projection's rows and columns whole 128 blocks
    save_tiny(src, "llama", {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64})
    model_dir = to_fp8_block(src, tmp_path / "fp8", (128, 128))
    calls = []
    real = fp8_gemm.block_scaled_mm
    monkeypatch.setattr(fp8_gemm, "block_scaled_mm", lambda *a: calls.append(1) or real(*a))
    prompts = random_prompts(4, 5, 40)
    fast = generate(model_dir, prompts)
    assert len(calls) >= 7 * 2  # every quantized layer of both layers took the GEMM, at least once
    monkeypatch.setattr(fp8_gemm, "available", lambda: False)
    slow = generate(model_dir, prompts)
    same = sum(a == b for a, b in zip(fast, slow))
    print(f"FP8 GEMM against dequantized: {same} of {len(prompts)} prompts token-equal")
    assert same >= len(prompts) - 1
