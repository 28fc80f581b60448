"""LoRA adapters at the router: which adapter a request names, which workers have it, and the 404 for one no
worker has.

Each worker's /v1/models is read with its health check (router/workers.py): its base model (the card without a
`parent`) and its adapters (the cards whose `parent` is a base model), so a worker that loads or unloads one is
seen at the next round (`--no-adapter-routing`: never read, so every request is placed and hashed as the base
model's, as before the router knew adapters). A request names its adapter as the servers read it
(common/http/adapters.py): /generate's `lora_path`, else OpenAI's `model` as the adapter's name (vLLM) or
`BASE:NAME` (SGLang); the base model's name, none, "" or "default" is the base model, and so is every request
while no worker's list is known (the servers tell).

The placer (router/placement/placer.py) places an adapter's request among the workers that list it, before those
whose list is unknown (not a Tandem server, or /v1/models failed), never on one that lists others only; the KV
index keys its pages by the adapter's name (router/placement/kv_policy.py). A request whose adapter no worker of
a role has (every worker's list being known) is a 404 naming it, from the router, before anything is sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.wire.errors import NotFound

if TYPE_CHECKING:
    from router.workers import Worker

BASE_NAMES = (None, "", "default")  # what selects the base model besides its own name (as the servers)


@dataclass(frozen=True)
class ServedModels:
    """What one worker's /v1/models lists."""

    base: str | None
    adapters: frozenset[str]


def served_models(answer: Any) -> ServedModels | None:
    """A /v1/models answer's base model and adapters; None when it is not an OpenAI model list."""
    cards = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(cards, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards):
        return None
    bases = [c["id"] for c in cards if not c.get("parent")]
    return ServedModels(bases[0] if bases else None, frozenset(c["id"] for c in cards if c.get("parent")))


def request_adapter(body: dict[str, Any], workers: Iterable[Worker]) -> str | None:
    """The adapter `body` runs under (None: the base model), read as the servers read it."""
    bases = {w.models.base for w in workers if w.models is not None}
    lora_path, model = body.get("lora_path"), body.get("model")
    if not bases:
        return None
    if isinstance(lora_path, str):
        return lora_path
    if not isinstance(model, str) or model in BASE_NAMES or model in bases:
        return None
    base, sep, adapter = model.partition(":")
    return adapter if sep and base in bases else model


def has(worker: Worker, adapter: str | None) -> bool | None:
    """Whether the worker serves `adapter` (the base model: always); None when its list is unknown."""
    if adapter is None:
        return True
    return None if worker.models is None else adapter in worker.models.adapters


def preferred(workers: list[Worker], adapter: str | None) -> list[Worker]:
    """The workers that list `adapter`, else those whose list is unknown (the base model: every worker)."""
    if adapter is None:
        return workers
    listed = [w for w in workers if has(w, adapter)]
    return listed or [w for w in workers if has(w, adapter) is None]


def missing_adapter(body: dict[str, Any], workers: list[Worker]) -> NotFound | None:
    """The 404 for a request whose adapter no worker of a role has (prefills counted when there are any), when
    every worker's list is known; None otherwise."""
    adapter = request_adapter(body, workers)
    if adapter is None or any(w.models is None for w in workers):
        return None
    for role in ("decode", "prefill"):
        of_role = [w for w in workers if w.role == role]
        if of_role and not any(has(w, adapter) for w in of_role):
            return NotFound(_message(body, adapter, role, workers), param=_param(body))
    return None


def _param(body: dict[str, Any]) -> str:
    return "lora_path" if isinstance(body.get("lora_path"), str) else "model"


def _message(body: dict[str, Any], adapter: str, role: str, workers: list[Worker]) -> str:
    served = sorted({a for w in workers if w.role == role for a in w.models.adapters})
    names = ", ".join(repr(a) for a in served) or "none"
    what = f"lora_path {adapter!r}" if _param(body) == "lora_path" else f"model {body.get('model')!r}"
    return f"{what}: no {role} worker serves the adapter {adapter!r}; the {role} workers' adapters: {names}"
