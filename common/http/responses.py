"""A server's Responses API (a monolithic server's; the router has its own, router/responses.py): `POST
/v1/responses` as the chat completion under it (common/http/openai_api.py's chat_answer), translated by
common/wire/responses_*.py; `GET` / `DELETE /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` on the
server's store.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.edge.asgi import read_body, sse_response
from common.engine.engine import Engine
from common.http.openai_api import chat_answer
from common.wire.api import ChatCompletionRequest, parse_body
from common.wire.body import parse_json_object
from common.wire.errors import TandemError
from common.wire.responses_call import ResponseCall, Responses, renamed
from common.wire.responses_store import ResponsesStore
from common.wire.responses_stream import SSETranslator


def add_responses_api(app: FastAPI, engine: Engine) -> None:
    responses = Responses(ResponsesStore(engine.config.responses_store_size))

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        call = ResponseCall(parse_json_object(await read_body(request, engine.config.max_request_bytes)), responses)
        call.shell.model = engine.model_name
        try:
            body = parse_body(json.dumps(call.chat).encode(), ChatCompletionRequest)
            answer = await chat_answer(engine, body, request)
        except TandemError as e:
            raise renamed(e) from None
        if not call.req.stream:
            return JSONResponse(call.answer(json.loads(answer.body)))
        return sse_response(_events(call.translator(), answer.body_iterator))

    @app.get("/v1/responses/{response_id}")
    async def get(response_id: str) -> dict[str, Any]:
        return responses.store.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        responses.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> dict[str, Any]:
        return responses.cancel(response_id)


async def _events(translator: SSETranslator, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The chat stream's events translated; a cancelled response stops reading it (closing the chat stream
    aborts its request)."""
    try:
        async for data in chunks:
            out = translator.feed(data)
            if out:
                yield out
            if translator.ended:
                break
    finally:
        translator.abandon()
        await chunks.aclose()
