"""The CUDA FP8 GEMM's side of the seam, on the CPU: torch's block-scaled `scaled_mm` replaced by a fake
that computes what its documentation says from the layout it is given (and checks that layout), so the
activation quantization and the scale layouts we pass are checked here; the real kernel is checked on a
GPU by tests/gpu/test_fp8_gemm.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.parallel.layers import linear
from common.quant import fp8_gemm
from common.quant.fp8_block import BlockFP8
from tests.integration.fp8_models import dequantize_block, quantize_block


def fake_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16, **_):
    """torch's block-wise semantics: A [M, K] in 1x128 blocks, B [K, N] in 128x128 blocks, scales multiply."""
    (m, k), n = a.shape, b.shape[1]
    assert (recipe_a, recipe_b) == (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)
    assert a.dtype == b.dtype == torch.float8_e4m3fn and b.stride() == (1, k)  # B column-major
    assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)  # outer-dim-major
    assert scale_b.shape == (k // 128, n // 128)
    a_deq = a.float() * scale_a.repeat_interleave(128, 1)
    b_deq = b.float() * scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (a_deq @ b_deq).to(output_dtype)


def test_block_scaled_mm_passes_torch_the_layout_it_documents(monkeypatch):
    monkeypatch.setattr(F, "scaled_mm", fake_scaled_mm)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 256, generator=g), torch.randn(384, 256, generator=g)
    q, scale = quantize_block(w, (128, 128))
    bias = torch.randn(384, generator=g)
    want = x @ dequantize_block(q, scale, (128, 128)).t() + bias
    got = fp8_gemm.block_scaled_mm(x, q, scale, bias)
    assert got.dtype == torch.float32
    assert (got - want).norm() / want.norm() < 0.03  # the activations' FP8 rounding only


def test_activations_are_quantized_per_token_and_128_columns():
    x = torch.randn(3, 256) * torch.tensor([1.0, 100.0, 0.01])[:, None]
    q, scale = fp8_gemm.quantize_activations(x)
    assert scale.shape == (3, 2) and q.dtype == torch.float8_e4m3fn
    back = q.float() * scale.repeat_interleave(128, 1)
    assert ((back - x).abs() <= x.abs() * 0.0625 + 1e-30).all()  # half an FP8 step, relative, per element


def test_only_aligned_128_blocks_on_cuda_take_the_gemm_and_the_probe_fails_safely_on_the_cpu(monkeypatch):
    assert fp8_gemm.available() is False  # no CUDA here: the probe refuses, it does not raise
    x, w = torch.randn(2, 256), torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    assert not fp8_gemm.fits(x, w, (128, 128), (0, 0))  # a CPU tensor
    monkeypatch.setattr(fp8_gemm, "available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert fp8_gemm.fits(x, w, (128, 128), (0, 0))
    assert not fp8_gemm.fits(x, w, (64, 64), (0, 0))  # other blocks: dequantized
    assert not fp8_gemm.fits(x, w, (128, 128), (64, 0))  # a TP share starting inside a block
    assert not fp8_gemm.fits(x[:0], w, (128, 128), (0, 0))  # an idle batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_path_dequantizes_exactly_in_the_activations_dtype(dtype):
    w = torch.randn(256, 256)
    q, scale = quantize_block(w, (128, 128))
    x = torch.randn(4, 256).to(dtype)
    want = linear(x, dequantize_block(q, scale, (128, 128)).to(dtype))  # the layers' own product
    assert torch.equal(BlockFP8((128, 128)).apply(x, q, scale, None), want)
