"""The KV layout a prefill and a decode must share before any byte moves: published by the prefill in
its bootstrap registration, checked by the decode before it pairs (torch-free).

model_id: common.model.identity (config and weights' names and shapes); attention: mha | mla; kv_scales:
the FP8 cache's per-layer scales ("none" unquantized, "k=S,v=S" when every layer shares them, else a
hash of the list)."""

from __future__ import annotations

import hashlib
from typing import Any

LAYOUT_KEYS = (
    "model_id",
    "tp_size",
    "attention",
    "num_layers",
    "kv_heads",
    "head_dim",
    "dtype",
    "kv_scales",
    "page_size",
    "transfer_backend",
)


def kv_layout(pool: Any, backend: str, model_id: str = "", tp_size: int = 1) -> dict[str, Any]:
    """The layout of a KV pool (anything with the pool's attributes; with `tp_size` ranks, each rank's
    pool) moved by `backend`."""
    return {
        "model_id": model_id,
        "tp_size": tp_size,
        "attention": pool.kind,
        "kv_scales": scales_descriptor(pool.scales) if pool.quantized else "none",
        "num_layers": pool.num_layers,
        "kv_heads": pool.kv_heads,
        "head_dim": pool.head_dim,
        "dtype": str(pool.dtype).removeprefix("torch."),
        "page_size": pool.page_size,
        "transfer_backend": backend,
    }


def scales_descriptor(scales: list[tuple[float, float]]) -> str:
    if len(set(scales)) == 1:
        return f"k={scales[0][0]:g},v={scales[0][1]:g}"
    return "per-layer:" + hashlib.sha256(repr(scales).encode()).hexdigest()[:12]


def layout_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """A message naming every layout field that differs, or None when decode and prefill fit."""
    diffs = [
        f"{k}: decode has {mine.get(k)!r}, prefill has {theirs.get(k)!r}"
        for k in LAYOUT_KEYS
        if mine.get(k) != theirs.get(k)
    ]
    return "KV layout mismatch: " + "; ".join(diffs) if diffs else None
