"""Adapters loaded and unloaded at run time (--enable-lora): SGLang's `POST /load_lora_adapter` and
`/unload_lora_adapter`, and vLLM's same under /v1/. Bodies `{"lora_name", "lora_path", "pinned"}` and
`{"lora_name"}`; the answer is SGLang's `{"success", "error_message", "loaded_adapters": {name: path}}`, a
mistake one JSON error naming the field (an unknown adapter: 404). The adapter is read and checked off the
scheduler thread, then served from the next step on; /v1/models follows at once. An unloaded adapter runs the
requests already under it to their end, then leaves its slot (common/lora/manager.py)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from common.edge.asgi import read_body
from common.lora.adapter import load_adapter
from common.wire.api import parse_body
from common.wire.errors import InvalidRequest
from common.wire.user_error import UserError

if TYPE_CHECKING:
    from common.engine.engine import Engine
    from common.lora.manager import LoraManager

PATHS = ("/load_lora_adapter", "/v1/load_lora_adapter")
UNLOAD_PATHS = ("/unload_lora_adapter", "/v1/unload_lora_adapter")


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    pinned: bool = False


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)


def add_lora_routes(app: FastAPI, engine: Engine) -> None:
    async def load(request: Request) -> dict[str, Any]:
        body = parse_body(await read_body(request, engine.config.max_request_bytes), LoadLoraAdapter)
        lora = manager(engine)
        if engine.config.tp_size > 1:
            raise InvalidRequest(
                "loading an adapter at run time is not supported at --tp-size > 1 yet: give it in --lora-paths",
                param="lora_name",
            )
        try:
            adapter = await asyncio.to_thread(load_adapter, body.lora_name, body.lora_path, "lora_path")
            lora.shape.check(adapter, "lora_path")
        except UserError as e:
            raise InvalidRequest(str(e), param="lora_path") from None
        await asyncio.wrap_future(engine.run_on_scheduler(lambda: lora.add(adapter, body.pinned)))
        return loaded(lora)

    async def unload(request: Request) -> dict[str, Any]:
        body = parse_body(await read_body(request, engine.config.max_request_bytes), UnloadLoraAdapter)
        lora = manager(engine)
        await asyncio.wrap_future(engine.run_on_scheduler(lambda: lora.remove(body.lora_name)))
        return loaded(lora)

    for path in PATHS:
        app.add_api_route(path, load, methods=["POST"])
    for path in UNLOAD_PATHS:
        app.add_api_route(path, unload, methods=["POST"])


def manager(engine: Engine) -> LoraManager:
    if engine.lora is None:
        raise InvalidRequest("this server serves no adapters: start it with --enable-lora", param="lora_name")
    return engine.lora


def loaded(lora: LoraManager) -> dict[str, Any]:
    adapters = {n: str(a.path) for n in lora.ids if (a := lora.adapters.get(n)) is not None}
    return {"success": True, "error_message": None, "loaded_adapters": adapters}
