"""`common.parallel.layers.linear`: the one matrix product of the models equals F.linear on every shape
they give it (rows of a fused weight, 3-D activations, no rows at all), in float32 on the CPU through
oneDNN and in the other dtypes through F.linear itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.parallel.layers import ONEDNN_LINEAR, linear


@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (2, 5, 64), (0, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear_in_float32(shape, bias):
    torch.manual_seed(0)
    fused = torch.randn(96, 64)
    w = fused[32:80]  # rows of a fused weight, as fuse_columns leaves them
    b = torch.randn(48) if bias else None
    x = torch.randn(*shape)
    got = linear(x, w, b)
    assert got.shape == (*shape[:-1], 48) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_strided_weights_are_f_linear_bit_for_bit():
    x = torch.randn(3, 16)
    w = torch.randn(16, 8).t()  # not contiguous
    assert torch.equal(linear(x, w), F.linear(x, w))
    xb, wb = x.bfloat16(), torch.randn(8, 16).bfloat16()
    assert torch.equal(linear(xb, wb), F.linear(xb, wb))


def test_the_cpu_build_has_onednn():
    """The suite's torch (a CPU build) has oneDNN, so the fast path above is the one tested."""
    assert ONEDNN_LINEAR
