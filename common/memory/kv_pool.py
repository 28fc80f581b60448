"""Per-layer contiguous K and V buffers; page 0 is padding that is never allocated.

    k_buffers[layer]: [(num_pages + 1) * page_size, kv_heads, head_dim]   (same for v_buffers)
    page p holds token slots [p * page_size, (p + 1) * page_size); usable pages are 1..num_pages
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BufferInfo:
    """One registered buffer, as a transfer engine sees it."""

    data_ptr: int
    nbytes: int
    bytes_per_page: int


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token across every layer."""
    return 2 * num_layers * kv_heads * head_dim * dtype.itemsize


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
    ):
        sizes = {"num_layers": num_layers, "num_pages": num_pages, "page_size": page_size, "kv_heads": kv_heads, "head_dim": head_dim}
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVPool: {name} must be an int >= 1, got {value!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"KVPool: dtype must be a torch.dtype, got {dtype!r}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        shape = ((num_pages + 1) * page_size, kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [n, kv_heads, head_dim] into slots loc [n] of one layer."""
        self.k_buffers[layer][loc] = k.to(self.dtype)
        self.v_buffers[layer][loc] = v.to(self.dtype)

    def get_k(self, layer: int) -> torch.Tensor:
        return self.k_buffers[layer]

    def get_v(self, layer: int) -> torch.Tensor:
        return self.v_buffers[layer]

    @property
    def bytes_per_page(self) -> int:
        """One page of one layer's K (or V)."""
        return self.page_size * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return 2 * self.num_layers * (self.num_pages + 1) * self.bytes_per_page

    def buffer_infos(self) -> list[BufferInfo]:
        """All K layers, then all V layers (SGLang's order): what a transfer engine registers."""
        return [
            BufferInfo(b.data_ptr(), b.numel() * b.element_size(), self.bytes_per_page)
            for b in self.k_buffers + self.v_buffers
        ]
