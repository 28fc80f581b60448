"""The KV pool of DeepSeek's multi-head latent attention: per token and layer one plane, the latent
(kv_lora_rank wide) followed by the rotated rope key (qk_rope_head_dim), shared by every query head.

    buffer: [num_pages + 1, 1, num_layers, 1, page_size, kv_lora_rank + qk_rope_head_dim]

Page-major like KVPool (a run of pages is one piece for the transfer engine). Attention reads the plane
as K and its first kv_lora_rank values as V (common.model.mla absorbs the up-projections), so V is a
view: nothing is stored twice. FP8 uses the layer's K scale for both. With tensor parallelism every
rank keeps the whole latent, so a PD decode rank r receives (with its own transfer engine, as an MHA
pool's heads) prefill rank r's copy.
"""

from __future__ import annotations

import torch

from common.memory.kv_pool import KVPool, SlotIndex


class MLAPool(KVPool):
    kind = "mla"
    planes = 1

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        latent_dim: int,
        rope_dim: int,
        dtype: torch.dtype,
        device: str,
        compute_dtype: torch.dtype | None = None,
        scales: list[tuple[float, float]] | None = None,
    ):
        if not isinstance(latent_dim, int) or latent_dim < 1:
            raise ValueError(f"MLAPool: latent_dim must be an int >= 1, got {latent_dim!r}")
        scales = [(k, k) for k, _ in scales] if scales else None
        super().__init__(
            num_layers, num_pages, page_size, 1, latent_dim + rope_dim, dtype, device, compute_dtype, scales
        )
        self.latent_dim = latent_dim
        self._v = [k[..., :latent_dim] for k in self._k]

    def set_kv(self, layer: int, at: SlotIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """k: [n, 1, latent_dim + rope_dim]; v, its latent part, is already in it."""
        self._k[layer][at.page, :, at.offset] = self._store(k, self.scales[layer][0])
