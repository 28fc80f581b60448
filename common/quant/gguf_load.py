"""A Llama-family GGUF served kept quantized (`--quantization gguf`, vLLM's spelling), read with the `gguf`
package's reader straight from the file: no float32 copy on disk.

Each linear layer whose tensor is Q4_0, Q4_1 or Q4_K keeps its 4-bit codes and runs torch's CPU int4
kernel (common.quant.int4_cpu: activations in bfloat16, scales and offsets in bfloat16); every other tensor
(Q8_0, Q6_K, F16, BF16, F32: the embedding, the norms) is dequantized once at load, exactly as the `gguf`
package does, into the model's dtype. A 4-bit weight whose shape the kernel does not take (rows not a
multiple of 16) is dequantized too, with a warning naming it. llama.cpp stores attn_q and attn_k with
their rows permuted for its rotary layout; the loader undoes that as transformers' GGUF loader does, on
the codes' rows (a row permutation, exact).

TP: a rank keeps its rows (column-parallel) or columns (row-parallel) of the codes and the groups' scales;
a column split inside a group is refused naming the tensor. CPU only: the kernel is torch's CPU one.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from torch import nn

from common.parallel.layers import QuantizableLinear, Shard, param_shards
from common.quant.gguf_unpack import FLOAT, INT4, INT8, READ, Groups, dense, type_name, unpack
from common.quant.int4_cpu import Int4Weight, fits
from common.wire.user_error import UserError

log = logging.getLogger(__name__)
GGUF_FILE = "model.gguf"  # the kept directory's link to the file (common.model.loader.kept_gguf)
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Int4Linear:
    """A linear layer's method over its packed 4-bit weight (`weight`) and `scales_and_offsets`."""

    group: int
    rows: int
    columns: int
    scale_name = "scales_and_offsets"

    def apply(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        out = Int4Weight(weight, scale, self.group, self.rows, self.columns).product(x)
        return out if bias is None else out + bias

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, reuse=True) -> torch.Tensor:
        eye = torch.eye(self.columns, dtype=dtype, device=weight.device)
        return self.apply(eye, weight, scale, None).t().contiguous()

    def scale_shard(self, weight: Shard) -> None:
        return None  # the loader cuts the codes and the scales itself (load_gguf)


@dataclass(frozen=True)
class Tensor:
    """One GGUF tensor: its `raw` data (bytes per row for a block type), type and shape [rows, columns]."""

    name: str
    raw: np.ndarray
    kind: object
    shape: tuple[int, ...]


def read_tensors(path: Path) -> dict[str, Tensor]:
    """The file's tensors by the checkpoint name the model's parameters use."""
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise UserError(
            f"--quantization gguf: {path} is a GGUF of architecture {arch}; Tandem keeps only Llama-family GGUFs "
            "quantized; drop the flag to serve its dequantized copy"
        )
    out = {}
    for t in reader.tensors:
        stem, _, leaf = t.name.rpartition(".")
        layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
        base = f"model.layers.{layer[1]}.{LAYER.get(layer[2], layer[2])}" if layer else TOP.get(stem, stem)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        if t.tensor_type not in {**INT4, **INT8, **FLOAT}:
            raise UserError(
                f"{path}: {t.name} is of GGUF type {t.tensor_type.name}; --quantization gguf reads {READ}; drop the "
                "flag to serve the file's dequantized copy"
            )
        out[f"{base}.{leaf}"] = Tensor(t.name, t.data, t.tensor_type, shape)
    return out


@dataclass
class GGUFReport:
    """What the start-up summary says of a GGUF kept quantized."""

    kept: Counter
    dequantized: Counter

    def summary(self, resident: int, file_bytes: int) -> str:
        kept = ", ".join(f"{n} {k}" for k, n in sorted(self.kept.items()))
        rest = ", ".join(f"{n} {k}" for k, n in sorted(self.dequantized.items()))
        return (
            f"weights: gguf kept quantized, {kept} linear layers through torch's CPU int4 kernel (bfloat16 "
            f"activations); dequantized at load: {rest} tensors (embeddings, norms, other types); "
            f"{resident / 2**20:.2f} MiB resident for {file_bytes / 2**20:.2f} MiB in the file"
        )


def gguf_tensors(model: nn.Module, path: Path, device: str) -> dict[str, Tensor]:
    """The file's tensors for the meta `model`, every refusal made before any weight is read."""
    if device != "cpu":
        raise UserError(
            f"--quantization gguf runs on the CPU only (torch's CPU int4 kernel), not --device {device}; drop the "
            "flag to serve the GGUF's dequantized copy"
        )
    tensors = read_tensors(path)
    missing = sorted({n for n, _ in model.named_parameters()} - set(tensors))  # a tied lm_head is listed once
    if missing:
        raise UserError(f"{path}: no tensor for {missing[:3]}: not a GGUF of this model's layout")
    return tensors


def fill_gguf(model: nn.Module, tensors: dict[str, Tensor], config) -> GGUFReport:
    """Fill the materialized `model`: its 4-bit layers packed for the kernel, every other tensor dequantized."""
    parts = param_shards(model)
    report, kept = GGUFReport(Counter(), Counter()), set()
    for name, module in model.named_modules():
        t = tensors.get(f"{name}.weight")
        if isinstance(module, QuantizableLinear) and t is not None and t.kind in INT4:
            if keep_int4(module, name, t, parts.get(f"{name}.weight"), config):
                report.kept[type_name(t.kind)] += 1
                kept.add(name)
    for name, p in model.named_parameters():
        if name.rpartition(".")[0] not in kept:
            t = tensors[name]
            full = dense(t.raw, t.kind, t.shape[-1]).view(t.shape)
            p.data.copy_(cut(permuted(full, name, config), parts.get(name), p.shape))
            report.dequantized[type_name(t.kind)] += 1
    return report


def keep_int4(module: QuantizableLinear, name: str, t: Tensor, part: Shard | None, config) -> bool:
    """Give `module` its packed 4-bit weight (False: the shape does not fit the kernel; dequantized instead)."""
    groups = permuted_groups(unpack(t.raw, t.kind, t.shape[1]), f"{name}.weight", config)
    if part is not None and part.dim == 0:
        groups = groups.rows(slice(part.start, part.stop))
    elif part is not None:
        if part.start % groups.group or part.stop % groups.group:
            raise UserError(
                f"{t.name}: columns [{part.start}, {part.stop}) of this TP rank cut its groups of {groups.group}; "
                "give a --tp-size that divides its columns in whole groups"
            )
        groups = groups.columns(part.start, part.stop)
    rows, columns = groups.codes.shape
    if not fits(rows, columns, groups.group):
        log.warning(
            "%s: [%d, %d] does not fit the int4 kernel (rows a multiple of 16); dequantized",
            t.name,
            *groups.codes.shape,
        )
        return False
    packed = Int4Weight.pack(*groups.int4(), groups.group)
    module.weight = nn.Parameter(packed.packed, requires_grad=False)
    module.scales_and_offsets = nn.Parameter(packed.scales_and_offsets, requires_grad=False)
    module.quant = Int4Linear(groups.group, rows, columns)
    return True


def row_order(name: str, rows: int, config) -> torch.Tensor | None:
    """The rows of attn_q / attn_k in transformers' order (llama.cpp permutes them); None: as stored."""
    which = name.split(".")[-2]
    if which not in ("q_proj", "k_proj"):
        return None
    n = config.num_attention_heads if which == "q_proj" else config.num_key_value_heads
    return torch.arange(rows).view(n, rows // n // 2, 2).transpose(1, 2).reshape(-1)


def permuted(w: torch.Tensor, name: str, config) -> torch.Tensor:
    order = row_order(name, w.shape[0], config)
    return w if order is None else w[order]


def permuted_groups(g: Groups, name: str, config) -> Groups:
    order = row_order(name, g.codes.shape[0], config)
    return g if order is None else g.rows(order)


def cut(full: torch.Tensor, part: Shard | None, shape: torch.Size) -> torch.Tensor:
    """This rank's `part` of `full`; rows past its end (vocabulary padding) are zero."""
    if part is None:
        return full
    if part.dim == 1:
        return full[:, part.start : part.stop]
    out = torch.zeros(shape, dtype=full.dtype)
    have = full[part.start : part.stop]
    out[: have.shape[0]] = have
    return out
