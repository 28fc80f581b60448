"""Tiny random models rewritten in DeepSeek's FP8 block layout on disk: every quantizable linear weight as
float8_e4m3fn with a float32 `weight_scale_inv` of one value per block (w = q * scale_inv, as DeepSeek-V3's
checkpoints and transformers' FineGrainedFP8 read it), the config's `quantization_config` saying so.
Embeddings, norms, MoE router gates and lm_head stay as they were (DeepSeek leaves them unquantized)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
UNQUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "e_score_correction_bias")


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and name.endswith(".weight") and not any(u in name for u in UNQUANTIZED)


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale_inv [ceil(rows/bn), ceil(cols/bk)]): each block scaled so its largest value is FP8's."""
    (rows, cols), (bn, bk) = w.shape, block
    nr, nc = math.ceil(rows / bn), math.ceil(cols / bk)
    padded = torch.zeros(nr * bn, nc * bk, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(nr, bn, nc, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view(nr * bn, nc * bk)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 weight an FP8 block checkpoint means (the independent reading, for references)."""
    rows, cols = q.shape
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return q.float() * full


def to_fp8_block(src: Path, out: Path, block: tuple[int, int] = (128, 128), skip: tuple[str, ...] = ()) -> Path:
    """Rewrite the checkpoint at `src` into `out` in DeepSeek's FP8 block layout; names containing one of
    `skip` stay unquantized (and are listed in modules_to_not_convert)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            if quantizable(name, t) and not any(s in name for s in skip):
                tensors[name], tensors[name + "_scale_inv"] = quantize_block(t, block)
            else:
                tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    } | ({"modules_to_not_convert": list(skip)} if skip else {})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def to_compressed_fp8(src: Path, out: Path, strategy: str = "channel", static: bool = False) -> Path:
    """Rewrite `src` into `out` as llm-compressor writes FP8 (compressed-tensors `float-quantized`): each
    linear weight float8 with `weight_scale` [rows, 1] (channel) or [1] (tensor); `static`: per-tensor
    activation scales (`input_scale`) too, else dynamic per-token activations. lm_head stays unquantized."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            tensors[name] = t
            if quantizable(name, t):
                amax = t.abs().amax(dim=1, keepdim=True) if strategy == "channel" else t.abs().amax().view(1)
                scale = (amax.float() / FP8_MAX).clamp(min=1e-12)
                tensors[name] = (t.float() / scale).to(torch.float8_e4m3fn)
                tensors[name + "_scale"] = scale
                if static:
                    tensors[name.removesuffix(".weight") + ".input_scale"] = torch.tensor([0.02])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "symmetric": True}
    acts |= {"strategy": "tensor", "dynamic": False} if static else {"strategy": "token", "dynamic": True}
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def dequantize_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().view(-1, 1)
