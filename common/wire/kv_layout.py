"""The KV layout a prefill and a decode must share before any byte moves: published by the prefill in
its bootstrap registration, checked by the decode before it pairs (torch-free)."""

from __future__ import annotations

from typing import Any

LAYOUT_KEYS = ("tp_size", "num_layers", "kv_heads", "head_dim", "dtype", "page_size", "transfer_backend")


def kv_layout(pool: Any, backend: str, tp_size: int = 1) -> dict[str, Any]:
    """The layout of a KV pool (anything with the pool's attributes; with `tp_size` ranks, each rank's
    pool) moved by `backend`."""
    return {
        "tp_size": tp_size,
        "num_layers": pool.num_layers,
        "kv_heads": pool.kv_heads,
        "head_dim": pool.head_dim,
        "dtype": str(pool.dtype).removeprefix("torch."),
        "page_size": pool.page_size,
        "transfer_backend": backend,
    }


def layout_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """A message naming every layout field that differs, or None when decode and prefill fit."""
    diffs = [
        f"{k}: decode has {mine.get(k)!r}, prefill has {theirs.get(k)!r}"
        for k in LAYOUT_KEYS
        if mine.get(k) != theirs.get(k)
    ]
    return "KV layout mismatch: " + "; ".join(diffs) if diffs else None
