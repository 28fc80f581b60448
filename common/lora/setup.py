"""--enable-lora's set-up: the adapters of --lora-paths read and checked against the model's config before any
weight loads (read_lora), then, once this rank's shard of the model exists, its slots split as its layers are
(LoraSetup.slots) and rank 0's manager (LoraSetup.manager); a follower rank reads the same adapters and follows
rank 0's slots (common/lora/follower.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from common.config import ServerConfig
from common.lora.adapter import LoraAdapter, LoraEntry, load_adapter, parse_lora_paths
from common.lora.manager import LoraManager, LoraShape
from common.lora.slots import LoraShard, LoraSlots
from common.lora.targets import TARGET_MODULES
from common.model.llama import DecoderLayer
from common.model.registry import model_class
from common.model.rotary import head_dim_of
from common.parallel.layers import RowParallelLinear
from common.wire.errors import InvalidRequest
from common.wire.user_error import UserError

log = logging.getLogger(__name__)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_shapes(hf: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each target module of a Llama-family decoder layer."""
    d, hidden, inter = head_dim_of(hf), hf.hidden_size, hf.intermediate_size
    q, kv = hf.num_attention_heads * d, hf.num_key_value_heads * d
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def check_dense(hf: PretrainedConfig) -> None:
    """LoRA applies to the dense Llama family's projections (common/model/llama.py) only, so far."""
    if model_class(hf).layer_class is not DecoderLayer:
        arch = (hf.architectures or ["?"])[0]
        raise UserError(
            f"--enable-lora: {arch} is not served with adapters in this version (dense Llama-family models only)"
        )


@dataclass(frozen=True)
class LoraSetup:
    """The adapters --lora-paths names, read and checked, and the slots' shape."""

    config: ServerConfig
    entries: list[LoraEntry]
    adapters: list[LoraAdapter]
    shape: LoraShape

    def slots(self, model: nn.Module) -> LoraSlots:
        """This rank's slots: each module's A and B split as `model`'s layers are."""
        c, s = self.config, self.shape
        dtype = getattr(torch, c.torch_dtype_name)
        shards = model_shards(model, list(s.shapes))
        return LoraSlots(c.max_loras_per_batch, s.max_rank, s.shapes, s.layers, c.device, dtype, shards)

    def manager(self, model: nn.Module) -> LoraManager:
        """Rank 0's manager, every adapter served (a pinned one in its slot)."""
        manager = LoraManager([], self.slots(model), self.shape, tp=self.config.tp_size > 1)
        for e, a in zip(self.entries, self.adapters):
            try:
                manager.add(a, e.pinned)
            except InvalidRequest as err:
                raise UserError(f"--lora-paths: {err.message}") from None
        manager.numbers = {a.name: i + 1 for i, a in enumerate(self.adapters)}
        return manager


def model_shards(model: nn.Module, modules: list[str]) -> dict[str, LoraShard]:
    """Each target module's split on this rank, read off the first decoder layer's projections."""
    layer = model.model.layers[0]
    out = {}
    for m in modules:
        proj = getattr(layer.self_attn if m in ATTENTION else layer.mlp, m)
        out[m] = LoraShard(not isinstance(proj, RowParallelLinear), proj.start, proj.stop)
    return out


def read_lora(c: ServerConfig, hf: PretrainedConfig) -> LoraSetup | None:
    """--enable-lora's adapters, every one read and checked against the model's config before its weights load
    (a UserError naming the adapter), or None."""
    if not c.enable_lora:
        return None
    check_dense(hf)
    start = time.monotonic()
    entries = parse_lora_paths(c.lora_paths or [])
    if len({e.name for e in entries}) != len(entries):
        raise UserError("--lora-paths: two adapters have the same name; give each NAME=PATH a name of its own")
    adapters = [load_adapter(e.name, e.path) for e in entries]
    shape = lora_shape(c, hf, entries, adapters)
    for a in adapters:
        shape.check(a, "--lora-paths")
    log.info(
        "LoRA: %d adapters (%s), %d slots of rank %d over %s, read in %.2fs",
        len(adapters),
        ", ".join(a.name for a in adapters),
        c.max_loras_per_batch,
        shape.max_rank,
        ",".join(shape.shapes),
        time.monotonic() - start,
    )
    if c.speculative_algorithm is not None:
        log.info(
            "LoRA with --speculative-algorithm %s: the draft runs without the adapters; the target verifies each "
            "request's drafts under its own (greedy output unchanged, fewer drafts accepted)",
            c.speculative_algorithm,
        )
    return LoraSetup(c, entries, adapters, shape)


def lora_shape(
    c: ServerConfig, hf: PretrainedConfig, entries: list[LoraEntry], adapters: list[LoraAdapter]
) -> LoraShape:
    """The slots' rank (--max-lora-rank, else the widest of the adapters and the entries' max_rank, else 8) and
    modules (--lora-target-modules, else the adapters', else all seven: room for adapters loaded at run time)."""
    wanted = [a.rank for a in adapters] + [e.max_rank for e in entries if e.max_rank]
    max_rank = c.max_lora_rank or max(wanted, default=8)
    modules = c.lora_target_modules or sorted({m for a in adapters for m in a.modules}) or list(TARGET_MODULES)
    shapes = module_shapes(hf)
    return LoraShape({m: shapes[m] for m in modules}, hf.num_hidden_layers, max_rank)
