"""Per-tensor KV cache scales from a checkpoint: `model.layers.{i}.self_attn.k_scale` / `v_scale`
(also under `self_attn.attn.`, as vLLM's and llm-compressor's FP8 checkpoints name them), one float per
layer. A layer without them gets 1.0, SGLang's default. An FP8 KV cache stores x / scale and reads
back stored * scale."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from common.model.weights import fill_from_shard, read_header

SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")


def is_kv_scale(name: str) -> bool:
    return SCALE_NAME.match(name) is not None


def read_kv_scales(model_dir: Path, num_layers: int) -> tuple[list[tuple[float, float]], str]:
    """(k_scale, v_scale) per layer, and where they came from (for the start-up summary)."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    found = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        names = [n for n in read_header(shard)[0] if is_kv_scale(n)]
        values = {n: torch.zeros(1, dtype=torch.float32) for n in names}
        fill_from_shard(shard, names, values, {})  # whole scalars: no rank slices
        for name, value in values.items():
            layer, which = SCALE_NAME.match(name).groups()
            if int(layer) < num_layers:
                scales[int(layer)]["kv".index(which)] = float(value)
                found += 1
    source = f"from the checkpoint ({found} of {2 * num_layers})" if found else "1.0 (the checkpoint has none)"
    return [(k, v) for k, v in scales], source
