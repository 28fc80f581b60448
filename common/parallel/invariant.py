"""--enable-deterministic-inference's switch for the products every model calls: a row's result a function of
the row alone, whatever else is in its batch and wherever it sits there.

Measured (benchmarks/batch_invariance.py): on the CPU, oneDNN's float32 GEMM and torch's batched matmul give
each row the same bits for every M >= 2 (every row position, batch size up to 8192, 1 to 16 threads), and
bfloat16 for every M; only a single row (M = 1) takes another kernel (a GEMV, another summation order). So
with the switch on a one-row product is computed as two rows (the row twice) and the first is kept: one
kernel, one reduction order for every row. The row-wise reductions (RMSNorm's mean, softmax, log_softmax,
the sampler's cumsum) are batch-invariant as they are (measured by the same script). The switch is set once
per process, by the rank before its model runs (common/ranks/rank_model.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

_ON = False


def enable(on: bool) -> None:
    """Turn the batch-invariant products on (or off) for this process."""
    global _ON
    _ON = on


def enabled() -> bool:
    return _ON


def per_row(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """product(x), with x's one row (dim 0) computed as two when the switch is on: the kernel every batch size
    of two or more rows takes."""
    if not _ON or x.shape[0] != 1:
        return product(x)
    return product(x.expand(2, *x.shape[1:]))[:1]
