"""One PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors), read into host memory.

PEFT's names: `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]); the delta of a module is `x A^T B^T * lora_alpha / r` (sqrt(r) with
use_rslora). Every mistake is a UserError naming the adapter and what to do.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.lora.targets import TARGET_MODULES
from common.wire.user_error import UserError

KEY = re.compile(r".*layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoraAdapter:
    """`weights[(layer, module)]` = (A [r, in], B [out, r]) in float32 on the host."""

    name: str
    path: Path
    rank: int
    scaling: float
    modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LoraEntry:
    """One adapter to serve: --lora-paths' entry or /load_lora_adapter's body. `pinned`: never evicted from its
    slot (SGLang's); `max_rank`: the slots are made at least this wide (room for a larger rank loaded later)."""

    name: str
    path: str
    pinned: bool = False
    max_rank: int | None = None


ENTRY_KEYS = {"lora_name", "lora_path", "pinned", "max_rank"}


def parse_lora_paths(entries: list[str]) -> list[LoraEntry]:
    """--lora-paths: each `NAME=PATH` (SGLang's and vLLM's form), a bare PATH named after its last part, a JSON
    object `{"lora_name", "lora_path", "pinned", "max_rank"}` (SGLang's) or a JSON list of them."""
    out: list[LoraEntry] = []
    for entry in entries:
        if entry.lstrip().startswith(("{", "[")):
            parsed = _json_entries(entry)
            out += [_json_entry(e, entry) for e in (parsed if isinstance(parsed, list) else [parsed])]
        else:
            name, sep, path = entry.partition("=")
            out.append(LoraEntry(name, path) if sep else LoraEntry(Path(entry).name, entry))
    return out


def _json_entries(entry: str) -> object:
    try:
        return json.loads(entry)
    except json.JSONDecodeError as e:
        raise UserError(f"--lora-paths {entry}: not valid JSON ({e.msg}); give NAME=PATH or a JSON object") from None


def _json_entry(e: object, entry: str) -> LoraEntry:
    ok = isinstance(e, dict) and isinstance(e.get("lora_name"), str) and isinstance(e.get("lora_path"), str)
    if not ok or set(e) - ENTRY_KEYS:
        raise UserError(
            f"--lora-paths {entry}: give each JSON adapter lora_name and lora_path (strings), optionally pinned "
            "(true/false) and max_rank (an integer), nothing else"
        )
    pinned, max_rank = e.get("pinned", False), e.get("max_rank")
    if not isinstance(pinned, bool) or not (max_rank is None or (type(max_rank) is int and max_rank >= 1)):
        raise UserError(f"--lora-paths {entry}: pinned must be true or false, max_rank a positive integer")
    return LoraEntry(e["lora_name"], e["lora_path"], pinned, max_rank)


def load_adapter(name: str, path: str, label: str = "--lora-paths") -> LoraAdapter:
    """The adapter at `path`, checked for what Tandem can apply (not yet against a model: check_fits). `label`:
    what a mistake names (the flag, or /load_lora_adapter's field)."""
    where = Path(path)
    config_file, weights_file = where / "adapter_config.json", where / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise UserError(
            f"{label} {name}={path}: no adapter_config.json and adapter_model.safetensors there "
            "(give a PEFT adapter directory)"
        )
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise UserError(f"{label} {name}: only plain LoRA adapters are served (no rank or alpha patterns)")
    rank = int(config["r"])
    scale = config.get("lora_alpha", rank) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights = _read_weights(f"{label} {name}", load_file(str(weights_file)))
    modules = frozenset(m for _, m in weights)
    return LoraAdapter(name, where, rank, scale, modules, weights)


def _read_weights(label: str, tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], tuple]:
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = KEY.match(key)
        if m is None:
            raise UserError(f"{label}: weight {key} is not a LoRA A or B of a decoder layer's projection")
        layer, module, ab = int(m[1]), m[2], m[3]
        if module not in TARGET_MODULES:
            raise UserError(f"{label}: target module {module} is not supported (only {', '.join(TARGET_MODULES)})")
        parts.setdefault((layer, module), {})[ab] = t.float()
    if any(len(p) != 2 for p in parts.values()):
        raise UserError(f"{label}: a module has lora_A without lora_B or the other way round")
    return {k: (p["A"], p["B"]) for k, p in parts.items()}


def check_fits(
    adapter: LoraAdapter, shapes: dict[str, tuple[int, int]], layers: int, max_rank: int, label: str = "--lora-paths"
) -> None:
    """The adapter was made for this base model (`shapes`: module -> (out, in)), within --max-lora-rank."""
    if adapter.rank > max_rank:
        raise UserError(f"{label} {adapter.name}: rank {adapter.rank} is above --max-lora-rank {max_rank} (raise it)")
    for (layer, module), (a, b) in adapter.weights.items():
        out, inp = shapes[module]
        if layer >= layers or a.shape != (adapter.rank, inp) or b.shape != (out, adapter.rank):
            raise UserError(
                f"{label} {adapter.name}: layer {layer}'s {module} ({b.shape[0]}x{a.shape[1]}) does not fit the "
                f"model ({layers} layers, {module} {out}x{inp}): the adapter was made for another base model"
            )
