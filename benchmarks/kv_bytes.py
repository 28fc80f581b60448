"""KV bytes per token (every layer) by pool kind and stored dtype: what the pool holds per token and
what crosses the wire per token in PD (a transfer moves whole pages of the pool).

    PYTHONPATH=. .venv/bin/python benchmarks/kv_bytes.py

"MHA equivalent" is the same DeepSeek model with its K (qk_nope + qk_rope) and V (v_head_dim) cached
per head, as a decompressed cache (or SGLang's MHA path) would hold them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.core.attention_spec import AttentionSpec  # noqa: E402
from common.memory.pool_factory import pool_bytes_per_token  # noqa: E402

# (layers, heads, kv_lora_rank, qk_rope, qk_nope, v_head_dim) from the models' config.json
DEEPSEEK = {"DeepSeek-V2-Lite": (27, 16, 512, 64, 128, 128), "DeepSeek-V3": (61, 128, 512, 64, 128, 128)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def rows() -> list[tuple[str, str, str, int]]:
    out = []
    smol = AttentionSpec("mha", 30, 9, 3, 64, 64, 0.125)  # SmolLM2-135M, the built-in model
    for name, dtype in DTYPES.items():
        out.append(("SmolLM2-135M (built-in)", "MHA", name, pool_bytes_per_token(smol, dtype)))
    for model, (layers, heads, r, rope, nope, v) in DEEPSEEK.items():
        mla = AttentionSpec("mla", layers, heads, 1, r + rope, r, 1.0)
        for name, dtype in DTYPES.items():
            mha = layers * heads * (nope + rope + v) * dtype.itemsize
            out.append((model, "MHA equivalent", name, mha))
            out.append((model, "MLA", name, pool_bytes_per_token(mla, dtype)))
    return out


if __name__ == "__main__":
    print("| model | pool | KV dtype | bytes per token |")
    print("|---|---|---|---|")
    for model, kind, dtype, n in rows():
        print(f"| {model} | {kind} | {dtype} | {n:,} |")
