"""The KV pool, page-major: one buffer holding, page after page, every layer's K and V of that page.

    buffer: [num_pages + 1, kv_heads, num_layers, 2 (K, V), page_size, head_dim]
    page p holds token slots [p * page_size, (p + 1) * page_size); usable pages are 1..num_pages; page 0
    is padding that is never allocated

A run of consecutive pages is one contiguous byte range across every layer, so the transfer engine moves
it as one piece (a layer-major pool needs 2 x num_layers pieces per run: SGLang's "page_first" host
layout makes the same choice). Inside a page the KV heads come first: a group of consecutive heads is
one contiguous range of the page, so a decode at another TP size receives its heads of a page as one
piece (transfer/prefill/head_slices.py). Attention reads a layer through `k_pages(layer)`: a strided
[num_pages + 1, kv_heads, page_size, head_dim] view (FlashInfer's HND paged layout; its kernels take the
strides). DeepSeek's MLA keeps one plane instead of K and V (common.memory.mla_pool).

FP8 (`--kv-cache-dtype fp8_e4m3|fp8_e5m2`): the pool stores float8, written as x / scale (clamped to
the format's range) and read back as stored * scale in the model's dtype, with one scale per layer for
K and one for V (`scales`, common.model.kv_scales). The buffer itself is uint8 and every float8 value is
a view of its bytes (as SGLang stores it): indexing and index_put then run on uint8, which every device
supports, and only the casts to and from the model's dtype see float8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class BufferInfo:
    """One registered buffer, as a transfer engine sees it."""

    data_ptr: int
    nbytes: int
    bytes_per_page: int


class SlotIndex(NamedTuple):
    """Token slots as (page, offset in page): how the page-major pool is indexed."""

    page: torch.Tensor
    offset: torch.Tensor


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, planes: int = 2) -> int:
    """K and V (`planes` 2; MLA's latent: 1) of one token across every layer."""
    return planes * num_layers * kv_heads * head_dim * dtype.itemsize


class KVPool:
    kind = "mha"
    planes = 2  # K, V

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        compute_dtype: torch.dtype | None = None,
        scales: list[tuple[float, float]] | None = None,
    ):
        """`dtype`: what the buffer stores; `compute_dtype`: what reads return (default: `dtype`);
        `scales`: (k_scale, v_scale) per layer, used when `dtype` is a float8 (default 1.0)."""
        sizes = {
            "num_layers": num_layers,
            "num_pages": num_pages,
            "page_size": page_size,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
        }
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVPool: {name} must be an int >= 1, got {value!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"KVPool: dtype must be a torch.dtype, got {dtype!r}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        self.compute_dtype = compute_dtype or dtype
        self.quantized = dtype.is_floating_point and dtype.itemsize == 1
        self.scales = scales or [(1.0, 1.0)] * num_layers
        if len(self.scales) != num_layers:
            raise ValueError(f"KVPool: {len(self.scales)} scales for {num_layers} layers")
        shape = (num_pages + 1, kv_heads, num_layers, self.planes, page_size, head_dim)
        self.buffer = torch.zeros(shape, dtype=torch.uint8 if self.quantized else dtype, device=device)
        self._k = [self.buffer[:, :, layer, 0] for layer in range(num_layers)]
        self._v = [self.buffer[:, :, layer, self.planes - 1] for layer in range(num_layers)]

    def locate(self, slots: torch.Tensor) -> SlotIndex:
        """Token slots (any shape) as page and offset, computed once per forward and used by every layer."""
        return SlotIndex(torch.div(slots, self.page_size, rounding_mode="floor"), slots % self.page_size)

    def set_kv(self, layer: int, at: SlotIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [n, kv_heads, head_dim] into the n slots `at` of one layer."""
        self._k[layer][at.page, :, at.offset] = self._store(k, self.scales[layer][0])
        self._v[layer][at.page, :, at.offset] = self._store(v, self.scales[layer][1])

    def _store(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.quantized:
            return x.to(self.dtype)
        limit = torch.finfo(self.dtype).max
        return (x.float() / scale).clamp(-limit, limit).to(self.dtype).view(torch.uint8)

    def _load(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x.view(self.dtype).to(self.compute_dtype) * scale) if self.quantized else x

    def k_at(self, layer: int, at: SlotIndex) -> torch.Tensor:
        """One layer's K of the slots `at`: [*at.shape, kv_heads, head_dim] (a copy, in compute_dtype
        when the pool is FP8)."""
        return self._load(self._k[layer][at.page, :, at.offset], self.scales[layer][0])

    def v_at(self, layer: int, at: SlotIndex) -> torch.Tensor:
        return self._load(self._v[layer][at.page, :, at.offset], self.scales[layer][1])

    def k_pages(self, layer: int) -> torch.Tensor:
        """One layer's K as a [num_pages + 1, kv_heads, page_size, head_dim] view (HND, strided across pages
        and heads; FP8: the float8 view of the bytes)."""
        return self._k[layer].view(self.dtype)

    def v_pages(self, layer: int) -> torch.Tensor:
        return self._v[layer].view(self.dtype)

    @property
    def bytes_per_page(self) -> int:
        """One page: K and V (or the latent) of page_size tokens across every layer, contiguous."""
        return self.buffer[0].numel() * self.buffer.element_size()

    @property
    def total_bytes(self) -> int:
        return (self.num_pages + 1) * self.bytes_per_page

    @property
    def device_index(self) -> int:
        """The CUDA device the buffer lives on (0 on the CPU): the one a transfer engine registers."""
        return self.buffer.device.index or 0

    def buffer_infos(self) -> list[BufferInfo]:
        """What a transfer engine registers: the one buffer."""
        return [BufferInfo(self.buffer.data_ptr(), self.total_bytes, self.bytes_per_page)]
