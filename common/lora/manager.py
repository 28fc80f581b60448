"""The LoRA manager: the adapters a server serves (by name, each with its prefix-cache namespace), the slot
pool, and each running request's slot. The prefill queue admits a request only when its adapter can be
pinned (LoraManager.admit); the scheduler unpins it when its memory is freed (release); the model runner asks
for each batch's segments (batch)."""

from __future__ import annotations

import logging
import time

import torch
from transformers import PretrainedConfig

from common.config import ServerConfig
from common.core.request import Req
from common.lora.adapter import LoraAdapter, check_fits, load_adapter, parse_lora_path
from common.lora.batch import LoraBatch, make_lora_batch, segments_of
from common.lora.slots import LoraSlots
from common.model.llama import DecoderLayer
from common.model.registry import model_class
from common.model.rotary import head_dim_of
from common.wire.user_error import UserError

log = logging.getLogger(__name__)


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


class LoraManager:
    def __init__(self, adapters: list[LoraAdapter], slots: LoraSlots):
        self.adapters = {a.name: a for a in adapters}
        self.ids = {a.name: i + 1 for i, a in enumerate(adapters)}  # 0: the base model's namespace
        self.slots = slots
        self.pinned: dict[Req, int] = {}  # running request -> its slot

    def can_admit(self, req: Req) -> bool:
        return req.lora is None or req in self.pinned or self.slots.can_pin(req.lora)

    def admit(self, req: Req) -> None:
        """Pin the request's adapter in a slot (idempotent: a retracted request keeps its pin)."""
        if req.lora is not None and req not in self.pinned:
            self.pinned[req] = self.slots.pin(self.adapters[req.lora])

    def release(self, req: Req) -> None:
        slot = self.pinned.pop(req, None)
        if slot is not None:
            self.slots.unpin(slot)

    def batch(self, reqs: list[Req], lens: list[int]) -> LoraBatch | None:
        """The segments of a batch of `reqs` with `lens` new tokens each; None when none has an adapter."""
        row_slots = [self.pinned.get(r) for r in reqs]
        if all(s is None for s in row_slots):
            return None
        return make_lora_batch(segments_of(row_slots, lens), self.slots, self.slots.device)


def make_lora_manager(c: ServerConfig, hf: PretrainedConfig) -> LoraManager | None:
    """--enable-lora's manager, every adapter read and checked against the model's config before its weights load
    (a UserError naming the adapter), or None."""
    if not c.enable_lora:
        return None
    check_dense(hf)
    start = time.monotonic()
    entries = [parse_lora_path(e) for e in c.lora_paths or []]
    if len({name for name, _ in entries}) != len(entries):
        raise UserError("--lora-paths: two adapters have the same name; give each NAME=PATH a name of its own")
    adapters = [load_adapter(name, path) for name, path in entries]
    max_rank = c.max_lora_rank or max((a.rank for a in adapters), default=8)
    modules = c.lora_target_modules or sorted({m for a in adapters for m in a.modules})
    shapes = module_shapes(hf)
    for a in adapters:
        check_fits(a, shapes, hf.num_hidden_layers, max_rank)
        if not a.modules <= set(modules):
            extra = ", ".join(sorted(a.modules - set(modules)))
            raise UserError(f"--lora-paths {a.name}: targets {extra}, not in --lora-target-modules: add it")
    used = {m: shapes[m] for m in modules}
    dtype = getattr(torch, c.torch_dtype_name)
    slots = LoraSlots(c.max_loras_per_batch, max_rank, used, hf.num_hidden_layers, c.device, dtype)
    log.info(
        "LoRA: %d adapters (%s), %d slots of rank %d over %s, read in %.2fs",
        len(adapters),
        ", ".join(a.name for a in adapters),
        c.max_loras_per_batch,
        max_rank,
        ",".join(modules),
        time.monotonic() - start,
    )
    return LoraManager(adapters, slots)
