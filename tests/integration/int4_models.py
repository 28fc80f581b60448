"""Tiny random models rewritten in the 4-bit layouts on disk, each linear weight quantized round-to-nearest
in groups of `group` input columns (asymmetric: a scale and a zero point per group; symmetric: zero 8):

    pack-quantized  written by compressed-tensors' own `pack_to_int32` (what llm-compressor saves)
    awq             AutoAWQ's GEMM layout; compressed-tensors' AutoAWQConverter (vLLM's) reads it back
    gptq            GPTQ's v1 layout (qzeros hold z - 1), with desc_act: a random g_idx per layer

and the float32 weights each means (`dequantized`), which the references load: transformers'
compressed-tensors loader for pack-quantized and AWQ (converted by compressed-tensors), a plain checkpoint
of the dequantized weights for GPTQ (read in vLLM's documented layout). Embeddings, norms and lm_head stay
as they were. Scales are float16, as AutoAWQ and GPTQ write them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.torch import load_file, save_file

from tests.integration.fp8_models import quantizable

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble i holds output column AWQ_ORDER[i]


def quantize_groups(w: torch.Tensor, group: int, symmetric: bool, lowest_zero: int = 0):
    """(codes [N, K] 0..15, scales [N, K/g] float16, zeros [N, K/g] int) with w ~ (codes - zeros) * scales."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    if symmetric:
        scales = (g.abs().amax(-1) / 7.5).clamp(min=1e-6).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-6).half()
        zeros = torch.round(-lo / scales.float()).long().clamp(lowest_zero, 15)
    codes = torch.round(g / scales.float()[..., None]) + zeros[..., None]
    return codes.clamp(0, 15).long().view(n, k), scales, zeros


def dequantized(codes, scales, zeros, group: int) -> torch.Tensor:
    expand = lambda t: t.float().repeat_interleave(group, dim=1)  # noqa: E731
    return (codes.float() - expand(zeros)) * expand(scales)


def pack_rows(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """Eight 4-bit values of each row's consecutive columns per int32 (value `order[i]` in nibble i)."""
    v = values.long().view(values.shape[0], -1, 8)[:, :, list(order)]
    word = sum(v[:, :, i] << (4 * i) for i in range(8))
    return (word - (word >> 31) * (1 << 32)).to(torch.int32)  # the top nibble's high bit is int32's sign


def rewrite(src: Path, out: Path, layer, qc: dict, plain: Path | None = None) -> Path:
    """`out`: src with each quantizable weight replaced by `layer(name, w)`'s tensors; `plain`: the
    dequantized weights (the second item `layer` returns) as an unquantized twin."""
    out.mkdir(parents=True, exist_ok=True)
    tensors, floats = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        if quantizable(name, t):
            made, floats[name] = layer(name.removesuffix(".weight"), t)
            tensors |= made
        else:
            tensors[name] = floats[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
            if plain is not None:
                plain.mkdir(parents=True, exist_ok=True)
                (plain / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": qc}, indent=2))
    if plain is not None:
        save_file(floats, plain / "model.safetensors", metadata={"format": "pt"})
        (plain / "config.json").write_text(json.dumps(config, indent=2))
    return out


def to_pack_quantized(src: Path, out: Path, group: int, symmetric: bool = False) -> Path:
    """`group` -1: strategy channel (one group of every input per row)."""

    def layer(prefix, w):
        codes, scales, zeros = quantize_groups(w, w.shape[1] if group == -1 else group, symmetric)
        made = {
            f"{prefix}.weight_packed": pack_to_int32((codes - 8).to(torch.int8), 4),
            f"{prefix}.weight_scale": scales,
            f"{prefix}.weight_shape": torch.tensor(list(w.shape)),
        }
        if not symmetric:
            made[f"{prefix}.weight_zero_point"] = pack_to_int32((zeros - 8).to(torch.int8), 4, packed_dim=0)
        return made, dequantized(codes, scales, zeros, w.shape[1] if group == -1 else group)

    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group}
    if group == -1:
        weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "channel"}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
    }
    return rewrite(src, out, layer, qc)


def to_awq(src: Path, out: Path, group: int) -> Path:
    def layer(prefix, w):
        codes, scales, zeros = quantize_groups(w, group, symmetric=False)
        made = {
            f"{prefix}.qweight": pack_rows(codes.t().contiguous(), AWQ_ORDER),
            f"{prefix}.qzeros": pack_rows(zeros.t().contiguous(), AWQ_ORDER),
            f"{prefix}.scales": scales.t().contiguous(),
        }
        return made, dequantized(codes, scales, zeros, group)

    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return rewrite(src, out, layer, qc)


def to_gptq(
    src: Path, out: Path, plain: Path, group: int, desc_act: bool, seed: int = 0, v2: bool = False, sym: bool = False
) -> Path:
    """GPTQ v1 (`v2`: gptq_v2, zero points stored as they are); with `desc_act` each layer's inputs are grouped
    in a random order, g_idx saying which; `sym`: every zero point 8."""
    gen = torch.Generator().manual_seed(seed)

    def layer(prefix, w):
        k = w.shape[1]
        perm = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
        codes_p, scales, zeros = quantize_groups(w[:, perm], group, symmetric=sym, lowest_zero=1)
        codes = torch.empty_like(codes_p)
        codes[:, perm] = codes_p  # input perm[j] is in group j // group
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
        made = {
            f"{prefix}.qweight": pack_rows(codes.contiguous()).t().contiguous(),  # inputs packed: [K/8, N]
            f"{prefix}.qzeros": pack_rows((zeros - (0 if v2 else 1)).t().contiguous()),
            f"{prefix}.scales": scales.t().contiguous(),
            f"{prefix}.g_idx": g_idx,
        }
        w_back = (codes.float() - zeros[:, g_idx.long()].float()) * scales[:, g_idx.long()].float()
        return made, w_back

    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
    }
    return rewrite(src, out, layer, qc, plain)
