"""The LoRA manager: the adapters a server serves (by name, each with its prefix-cache namespace), the slot
pool, and each running request's slot. The prefill queue admits a request only when its adapter can be
pinned (LoraManager.admit); the scheduler unpins it when its memory is freed (release); the model runner asks
for each batch's segments (batch). Adapters load and unload at run time (/load_lora_adapter, on the scheduler
thread): an unloaded adapter is served to no new request at once, and leaves its slot and host memory when the
last request that runs under it ends (end)."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from common.config import ServerConfig
from common.core.request import Req
from common.lora.adapter import LoraAdapter, LoraEntry, check_fits, load_adapter, parse_lora_paths
from common.lora.batch import LoraBatch, make_lora_batch, segments_of
from common.lora.slots import LoraSlots
from common.lora.targets import TARGET_MODULES
from common.model.llama import DecoderLayer
from common.model.registry import model_class
from common.model.rotary import head_dim_of
from common.wire.errors import InvalidRequest, NotFound, Unavailable
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


@dataclass(frozen=True)
class LoraShape:
    """What every slot holds room for: an adapter must fit it to load (check_fits)."""

    shapes: dict[str, tuple[int, int]]  # target module -> the base layer's (out, in)
    layers: int
    max_rank: int

    def check(self, adapter: LoraAdapter, label: str) -> None:
        if not adapter.modules <= set(self.shapes):
            extra = ", ".join(sorted(adapter.modules - set(self.shapes)))
            raise UserError(f"{label} {adapter.name}: targets {extra}, not in --lora-target-modules: add it")
        check_fits(adapter, self.shapes, self.layers, self.max_rank, label)


class LoraManager:
    def __init__(self, adapters: list[LoraAdapter], slots: LoraSlots, shape: LoraShape):
        self.adapters = {a.name: a for a in adapters}  # served, or unloaded with requests still under them
        self._next_id = itertools.count(1)  # 0: the base model's namespace; a reloaded name gets a new one
        self.ids = {a.name: next(self._next_id) for a in adapters}  # the served (replaced whole: HTTP reads it)
        self.slots, self.shape = slots, shape
        self.pinned: dict[Req, int] = {}  # running request -> its slot
        self.users: dict[Req, str] = {}  # every live request under an adapter (track .. end)

    # -- requests --------------------------------------------------------------------------------------------
    def track(self, req: Req) -> bool:
        """A request arrived at the scheduler: False when its adapter was unloaded since it was accepted."""
        if req.lora is None:
            return True
        if req.lora not in self.adapters:
            return False
        self.users[req] = req.lora
        return True

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

    def end(self, req: Req) -> None:
        """The request ended: its slot unpinned, and its adapter dropped if it was unloaded and this was its last."""
        self.release(req)
        name = self.users.pop(req, None)
        if name is not None and name not in self.ids and name not in self.users.values():
            self._drop(name)

    def batch(self, reqs: list[Req], lens: list[int]) -> LoraBatch | None:
        """The segments of a batch of `reqs` with `lens` new tokens each; None when none has an adapter."""
        row_slots = [self.pinned.get(r) for r in reqs]
        if all(s is None for s in row_slots):
            return None
        return make_lora_batch(segments_of(row_slots, lens), self.slots, self.slots.device)

    # -- run-time loading (on the scheduler thread) -------------------------------------------------------
    def add(self, adapter: LoraAdapter, pinned: bool = False) -> None:
        """Serve `adapter` (read and checked by its caller: LoraShape.check); 400 if its name is taken."""
        if adapter.name in self.adapters:
            still = "" if adapter.name in self.ids else " (unloaded, requests still run under it: retry when they end)"
            raise InvalidRequest(f"lora_name {adapter.name!r} is already loaded{still}", param="lora_name")
        if pinned and len(self.slots.kept) + 1 >= len(self.slots.held):
            raise InvalidRequest(
                f"lora_name {adapter.name!r}: pinning it would leave no slot for the other adapters "
                f"(--max-loras-per-batch {len(self.slots.held)}, {len(self.slots.kept)} pinned)",
                param="pinned",
            )
        if pinned and not self.slots.can_pin(adapter.name):
            raise Unavailable(f"lora_name {adapter.name!r}: every slot is in use by running requests; retry")
        self.adapters[adapter.name] = adapter
        self.ids = {**self.ids, adapter.name: next(self._next_id)}
        if pinned:
            self.slots.keep(adapter)

    def remove(self, name: str) -> int:
        """Serve `name` to no new request; it leaves once no live request runs under it. Returns how many do."""
        if name not in self.ids:
            raise NotFound(f"lora_name {name!r}: no such adapter; this server serves {self.served()}", "lora_name")
        self.ids = {n: i for n, i in self.ids.items() if n != name}
        running = sum(1 for n in self.users.values() if n == name)
        if not running:
            self._drop(name)
        return running

    def _drop(self, name: str) -> None:
        self.slots.evict(name)
        del self.adapters[name]
        log.info("LoRA adapter %s unloaded, its slot freed", name)

    def served(self) -> str:
        return ", ".join(repr(n) for n in self.ids) or "no adapters"

    def report(self) -> dict:
        """/get_server_info's `lora`."""
        unloading = sorted(set(self.adapters) - set(self.ids))
        return {
            "adapters": list(self.ids),
            "unloading": unloading,
            "slots": self.slots.report(),
            "loads": self.slots.loads,
        }


def make_lora_manager(c: ServerConfig, hf: PretrainedConfig) -> LoraManager | None:
    """--enable-lora's manager, every adapter read and checked against the model's config before its weights load
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
    dtype = getattr(torch, c.torch_dtype_name)
    slots = LoraSlots(c.max_loras_per_batch, shape.max_rank, shape.shapes, shape.layers, c.device, dtype)
    manager = LoraManager([], slots, shape)
    for e, a in zip(entries, adapters):
        try:
            manager.add(a, e.pinned)
        except InvalidRequest as err:
            raise UserError(f"--lora-paths: {err.message}") from None
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
    return manager


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
