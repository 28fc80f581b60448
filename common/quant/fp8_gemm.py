"""The CUDA FP8 GEMM for DeepSeek's 128x128 weight blocks: torch's block-scaled `scaled_mm` (cuBLAS on
Hopper), with the activations quantized at run time per token and 128 columns, as DeepSeek's own
inference (`act_quant`) and SGLang's `fp8` method do. The weight is never upcast.

torch's layout: A [M, K] row-major with dequantization scales [M, K/128] outer-dim-major (BlockWise1x128),
B = W^T [K, N] column-major with scales W_scale_inv^T [K/128, N/128] (BlockWise128x128).

Whether the GEMM runs here is decided once per process by a probe that compares it with the dequantized
product on a small problem; where it is missing, fails or differs (another GPU, another torch), every
layer dequantizes instead (common.quant.fp8_block) and the start-up log says so once.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
GROUP = 128
PROBE_TOL = 0.05  # relative: the activations' own FP8 rounding (3 mantissa bits) over K = 256


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 activations [M, K], their dequantization scales [M, K / 128], outer-dim-major)."""
    m, k = x.shape
    groups = x.float().view(m, k // GROUP, GROUP)
    scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, k)
    return q, scale.t().contiguous().t()


def block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None):
    """x W^T (+ bias) for an FP8 weight [N, K] in 128x128 blocks, in x's dtype."""
    q, scale_a = quantize_activations(x)
    recipe = F.ScalingType
    y = F.scaled_mm(
        q, weight.t(), scale_a, recipe.BlockWise1x128, scale_inv.t(), recipe.BlockWise128x128, output_dtype=x.dtype
    )
    return y if bias is None else y + bias


def fits(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int], offset: tuple[int, int]) -> bool:
    """Whether this product runs as the block-scaled GEMM (else: dequantize)."""
    aligned = block == (GROUP, GROUP) and offset == (0, 0) and weight.shape[0] % GROUP == 0
    return aligned and x.is_cuda and x.dim() == 2 and len(x) > 0 and weight.shape[1] % GROUP == 0 and available()


@cache
def available() -> bool:
    """The probe: torch's block-scaled GEMM on this device, within PROBE_TOL of the dequantized product."""
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(3, 2 * GROUP, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(2 * GROUP, 2 * GROUP, device="cuda", generator=g)
        scale = torch.rand(2, 2, device="cuda", generator=g) + 0.5
        q = (w / scale.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        want = x.float() @ (q.float() * scale.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)).t()
        got = block_scaled_mm(x, q, scale, None).float()
        ok = bool(((got - want).norm() / want.norm()) < PROBE_TOL)
    except (RuntimeError, AttributeError, TypeError, ValueError) as e:
        log.info("FP8 block weights: no block-scaled GEMM here (%s); each layer dequantizes", e)
        return False
    if not ok:
        log.warning("FP8 block weights: torch's block-scaled GEMM differs from the dequantized product; dequantizing")
    return ok
