"""Which LoRA adapter a request runs under (--enable-lora): OpenAI's `model` names it (vLLM: the adapter's name;
SGLang: `base:adapter`), /generate's `lora_path` (SGLang's; an adapter's name); an unknown one is a 404 naming it.
`/v1/models` lists the adapters beside the base model, each with its `parent`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.core.request import GenInput
from common.wire.errors import NotFound

if TYPE_CHECKING:
    from common.engine.engine import Engine

BASE_NAMES = (None, "", "default")  # what selects the base model besides its own name


def model_adapter(engine: Engine, model: str | None) -> str | None:
    """The adapter OpenAI's `model` selects, None for the base model."""
    if model in BASE_NAMES or model == engine.model_name:
        return None
    base, sep, adapter = model.partition(":")
    name = adapter if sep and base == engine.model_name else model
    if engine.lora is None or name not in engine.lora.ids:
        raise NotFound(f"model {model!r} does not exist; this server serves {served(engine)}", param="model")
    return name


def named_adapter(engine: Engine, lora_path: str | None) -> str | None:
    """The adapter /generate's `lora_path` names, None for the base model."""
    if lora_path is None:
        return None
    if engine.lora is None or lora_path not in engine.lora.ids:
        raise NotFound(f"lora_path {lora_path!r}: no such adapter; this server serves {served(engine)}", "lora_path")
    return lora_path


def run_under(engine: Engine, gen: GenInput, adapter: str | None) -> None:
    """Let `gen` run under `adapter` (its name and its prefix-cache namespace; unloaded meanwhile: 404)."""
    if adapter is not None:
        lora_id = engine.lora.ids.get(adapter)
        if lora_id is None:
            raise NotFound(f"lora adapter {adapter!r} was unloaded; this server serves {served(engine)}", "model")
        gen.lora, gen.lora_id = adapter, lora_id


def served(engine: Engine) -> str:
    """What a request may name here: the base model and each adapter (or how to serve adapters at all)."""
    if engine.lora is None:
        return f"{engine.model_name!r} only (no adapters: start it with --enable-lora --lora-paths NAME=PATH)"
    return ", ".join(repr(n) for n in [engine.model_name, *engine.lora.ids])


def model_cards(engine: Engine) -> list[dict[str, Any]]:
    """/v1/models: the base model, then each adapter with its `parent` (vLLM's fields)."""
    base = {"object": "model", "created": 0, "owned_by": "tandem", "max_model_len": engine.context_len}
    cards = [{"id": engine.model_name, **base, "root": engine.model_name, "parent": None}]
    lora = engine.lora
    for name in lora.ids if lora is not None else ():  # the served now (a snapshot: loads replace it whole)
        adapter = lora.adapters.get(name)
        if adapter is not None:
            cards.append({"id": name, **base, "root": str(adapter.path), "parent": engine.model_name})
    return cards
