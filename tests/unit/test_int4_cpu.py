"""The shared 4-bit CPU product equals the dequantized weight's float32 product (within bfloat16's
activation rounding), for every group size the kernel takes; shapes it does not take are refused."""

import pytest
import torch

from common.quant.int4_cpu import COMPUTE, Int4Weight, dequantize, fits


def random_int4(rows: int, columns: int, group: int):
    g = torch.Generator().manual_seed(rows * columns + group)
    codes = torch.randint(0, 16, (rows, columns), generator=g)
    scales = torch.rand(rows, columns // group, generator=g) * 0.05
    offsets = torch.randn(rows, columns // group, generator=g) * 0.05
    return codes, scales, offsets


@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_the_product_equals_the_dequantized_weights_product(group):
    codes, scales, offsets = random_int4(192, 512, group)
    weight = Int4Weight.pack(codes, scales, offsets, group)
    x = torch.randn(5, 512)
    want = x.to(COMPUTE).float() @ dequantize(codes, scales.to(COMPUTE), offsets.to(COMPUTE), group).t()
    got = weight.product(x)
    assert got.dtype == torch.float32 and got.shape == (5, 192)
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)
    assert weight.nbytes() == 192 * 512 // 2 + 512 // group * 192 * 2 * 2


def test_a_shape_the_kernel_does_not_take_is_refused():
    assert not fits(100, 512, 32) and not fits(192, 100, 32) and not fits(192, 512, 16)
    with pytest.raises(ValueError, match="does not fit"):
        Int4Weight.pack(*random_int4(100, 512, 32), 32)
