"""The LoRA manager: the adapters a server serves (by name, each with its prefix-cache namespace), the slot
pool, and each running request's slot. The prefill queue admits a request only when its adapter can be
pinned (LoraManager.admit); the scheduler unpins it when its memory is freed (release); the model runner asks
for each batch's segments (batch). Adapters load and unload at run time (/load_lora_adapter, on the scheduler
thread): an unloaded adapter is served to no new request at once, and leaves its slot and host memory when the
last request that runs under it ends (end)."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from common.core.request import Req
from common.lora.adapter import LoraAdapter, check_fits
from common.lora.batch import LoraBatch, make_lora_batch, segments_of
from common.lora.slots import LoraSlots
from common.wire.errors import InvalidRequest, NotFound, Unavailable
from common.wire.user_error import UserError

log = logging.getLogger(__name__)


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
    def __init__(self, adapters: list[LoraAdapter], slots: LoraSlots, shape: LoraShape, tp: bool = False):
        """`tp`: tensor parallelism: each batch carries its wire for the follower ranks (adapters by number:
        their place in --lora-paths, what a follower read too)."""
        self.tp = tp
        self.numbers = {a.name: i + 1 for i, a in enumerate(adapters)}
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
        segments = segments_of(row_slots, lens)
        wire = None
        if self.tp:
            held = [self.numbers.get(h, 0) if h is not None else 0 for h in self.slots.held]
            wire = [*held, *(n for segment in segments for n in segment)]
        return make_lora_batch(segments, self.slots, self.slots.device, wire)

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
