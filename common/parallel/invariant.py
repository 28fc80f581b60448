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


# On CUDA a kernel is picked by the whole product's shape (cuBLAS's heuristics, split-K, and torch's reduction
# kernels splitting one row's sum over several blocks when there are few rows), so a row's bits can change with
# the batch's M however many rows it has. There the rows go through products of one shape: tiles of TILE_ROWS
# rows (the last padded with zero rows, cut off after), each computed alone. A row's result is then a function
# of the row alone (the kernel and its reduction order are those of a TILE_ROWS-row product, the same for every
# tile; an output element's sum in a GEMM does not depend on which row of the tile it is). CUDA graphs pad a
# step to a captured batch size: the tiles are the same, so graphs and eager steps agree.
TILE_ROWS = 64


def tiled(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int = TILE_ROWS) -> torch.Tensor:
    """op(x) computed over dim 0 in tiles of exactly `tile` rows (the last padded with zeros): every call of
    `op` sees the same number of rows, whatever x's."""
    m = x.shape[0]
    pad = -m % tile
    if m == 0:
        return op(x)
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return torch.cat([op(x[i : i + tile]) for i in range(0, m + pad, tile)])[:m]


def rows(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A product of x's rows (dim 0), batch-invariant when the switch is on: in fixed tiles off the CPU
    (`tiled`: CUDA), a one-row product as two on the CPU (`per_row`, what its kernels need)."""
    if not _ON:
        return product(x)
    return per_row(product, x) if x.device.type == "cpu" else tiled(product, x)


def rowwise(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A reduction within each row of x (RMSNorm's mean): in fixed tiles off the CPU when the switch is on; as
    it is on the CPU (the CPU's row-wise reductions are batch-invariant, the module docstring)."""
    return tiled(op, x) if _ON and x.device.type != "cpu" else op(x)
