"""The KV layout a prefill and a decode must share before any byte moves: published by the prefill in
its bootstrap registration, checked by the decode before it pairs (torch-free).

model_id: common.model.identity (config and weights' names and shapes); attention: mha | mla; kv_scales:
the FP8 cache's per-layer scales ("none" unquantized, "k=S,v=S" when every layer shares them, else a
hash of the list); speculative: the speculative algorithm and its draft's identity ("none", "NGRAM",
"STANDALONE draft=<model id> layers=<n>", "NEXTN mtp=…", "EAGLE head=…"): a draft's KV is part of every page, so its identity must
match; NGRAM keeps no state beyond the tokens and pairs with a prefill that runs no speculation.
dp_size: attention DP ranks (each attention group of tp_size / dp_size ranks holds its
own requests' KV); experts: how MoE layers are laid out ("tp": a slice of every expert per rank, "ep N"
whole experts over N ranks, "+K" redundant copies; "none" for a dense model); weights: the weights'
quantization (common.quant.scheme: "none", "fp8 block 128x128", "awq int4 group 128, zero points"), which
both sides must run alike. The TP and DP sizes and the
expert layout may differ between prefill and decode: the prefill writes each decode rank of the request's
DP rank its KV heads; only an attention split that cannot hold the KV heads cannot be served."""

from __future__ import annotations

import hashlib
from typing import Any

from common.wire.kv_heads import split_problem

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
    "kv_checksum",
    "speculative",
    "dp_size",
    "experts",
    "weights",
)
# the data-plane engines a PD server may move KV with (both of a pair run the same: the layout's transfer_backend),
# what --transfer-backend and `tandem up --transfer-backend` accept; loopback, in-process, serves unit tests only
TRANSFER_BACKENDS = ("mooncake", "nixl")
LOOPBACK_BACKEND = "loopback"
ABSENT = {"kv_checksum": False, "speculative": "none", "weights": "none"}  # what a layout without these fields means
NO_DRAFT_STATE = ("none", "NGRAM")  # what crosses is the same as without speculation


SERVABLE = ("tp_size", "dp_size", "experts")  # may differ between the two sides


def kv_layout(
    pool: Any,
    backend: str,
    model_id: str = "",
    tp_size: int = 1,
    kv_heads: int = 0,
    checksum: bool = False,
    speculative: str = "none",
    dp_size: int = 1,
    experts: str = "none",
    weights: str = "none",
) -> dict[str, Any]:
    """The layout of a KV pool (anything with the pool's attributes; with `tp_size` ranks, each rank's
    pool) moved by `backend`. `kv_heads`: the model's KV heads, which the ranks split or replicate
    (common.wire.kv_heads; default: the pool's, as at TP 1); `checksum`: page runs carry checksums
    (--disaggregation-enable-kv-checksum: both sides or neither); `dp_size`, `experts`: see the module."""
    return {
        "model_id": model_id,
        "tp_size": tp_size,
        "dp_size": dp_size,
        "experts": experts,
        "attention": pool.kind,
        "kv_scales": scales_descriptor(pool.scales) if pool.quantized else "none",
        "num_layers": pool.num_layers,
        "kv_heads": kv_heads or pool.kv_heads,
        "head_dim": pool.head_dim,
        "dtype": str(pool.dtype).removeprefix("torch."),
        "page_size": pool.page_size,
        "transfer_backend": backend,
        "kv_checksum": checksum,
        "speculative": speculative,
        "weights": weights,
    }


def scales_descriptor(scales: list[tuple[float, float]]) -> str:
    if len(set(scales)) == 1:
        return f"k={scales[0][0]:g},v={scales[0][1]:g}"
    return "per-layer:" + hashlib.sha256(repr(scales).encode()).hexdigest()[:12]


def model_kv_heads(pool: Any, hf_config: Any, tp_size: int) -> int:
    """The model's KV heads as the layout counts them: the pool's at TP 1 and for MLA (one latent plane,
    which every rank holds whole), the config's when ranks split them."""
    return pool.kv_heads if tp_size == 1 or pool.kind == "mla" else hf_config.num_key_value_heads


def experts_layout(num_experts: int, ep_size: int, redundant: int) -> str:
    """The `experts` field: "none", "tp", or "ep N" with "+K" redundant copies."""
    if not num_experts:
        return "none"
    return "tp" if ep_size == 1 else f"ep {ep_size}" + (f" +{redundant}" if redundant else "")


def attention_problem(layout: dict[str, Any]) -> str | None:
    """Why this side's attention groups (tp_size / dp_size ranks each) cannot hold the model's KV heads."""
    tp, dp = layout.get("tp_size", 1), layout.get("dp_size", 1)
    if not isinstance(tp, int) or not isinstance(dp, int) or dp < 1 or tp % dp:
        return f"dp_size {dp} does not divide tp_size {tp}"
    return split_problem(layout.get("kv_heads", 1), tp // dp)


def layout_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """A message naming every layout field that differs and both layouts, or None when decode and
    prefill fit. The TP and DP sizes and the expert layout may differ: the prefill sends each decode rank
    of the request's DP rank its heads (common.wire.kv_heads), as long as each side's attention groups
    split the same KV heads."""
    diffs = [
        f"{k}: decode has {mine.get(k)!r}, prefill has {theirs.get(k)!r}"
        for k in LAYOUT_KEYS
        if k not in SERVABLE and _differs(k, mine.get(k), theirs.get(k))
    ]
    for side, layout in (("decode", mine), ("prefill", theirs)):
        problem = attention_problem(layout)
        if problem:
            diffs.append(
                f"{side} attention (tp_size {layout.get('tp_size')}, dp_size {layout.get('dp_size')}): {problem}"
            )
    if not diffs:
        return None
    return f"KV layout mismatch: {'; '.join(diffs)} (decode layout: {describe_layout(mine)}; prefill layout: {describe_layout(theirs)})"


def _differs(key: str, mine: Any, theirs: Any) -> bool:
    if key in ABSENT:  # a side whose layout predates the field runs without it
        mine, theirs = (ABSENT[key] if v is None else v for v in (mine, theirs))
    if key == "speculative":
        return mine != theirs and not (mine in NO_DRAFT_STATE and theirs in NO_DRAFT_STATE)
    return mine != theirs


def describe_layout(layout: dict[str, Any]) -> str:
    return ", ".join(f"{k}={layout.get(k)}" for k in LAYOUT_KEYS if k != "model_id")
