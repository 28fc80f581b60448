"""The router's Responses API: `POST /v1/responses` as a chat completion through a PD pair (the dispatcher
serves it as it serves /v1/chat/completions: placement, retries, migration), translated on the way back
(common/wire/responses_*.py); `GET` / `DELETE /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` on
the router's store (shared by a --processes N group).
"""

from __future__ import annotations

import json
import time

from aiohttp import web

from common.wire.body import parse_json_object, read_limited
from common.wire.errors import TandemError
from common.wire.responses_call import ResponseCall, Responses, responses_error
from router.dispatch import CHAT, Dispatcher, json_response
from router.request_hints import RequestHints

CHAT_JSON = json.JSONEncoder(separators=(",", ":"))


def add_responses_routes(app: web.Application, dispatcher: Dispatcher, responses: Responses, max_bytes: int) -> None:
    async def create(request: web.Request) -> web.StreamResponse:
        start = time.monotonic()
        try:
            raw = await read_limited(request.headers, request.content.iter_any(), max_bytes)
            call = ResponseCall(parse_json_object(raw), responses)
        except TandemError as e:
            return json_response(e.to_dict(), e.status, e.headers)
        chat_raw, hints = CHAT_JSON.encode(call.chat).encode(), RequestHints.from_headers(request.headers)
        relay = call.translator() if call.req.stream else None
        try:
            resp = await dispatcher.dispatch(CHAT, request, chat_raw, call.chat, start, hints, relay)
        finally:
            if relay is not None:
                relay.abandon()  # nothing when it ended (completed, failed, cancelled)
        if resp.prepared:  # a stream: its events went out through the relay
            return resp
        answer = json.loads(resp.body)
        if resp.status != 200:
            return json_response(responses_error(answer), resp.status, _retry_after(resp))
        return json_response(call.answer(answer))

    async def get(request: web.Request) -> web.Response:
        return json_response(responses.store.get(request.match_info["response_id"]))

    async def delete(request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        responses.store.delete(rid)
        return json_response({"id": rid, "object": "response.deleted", "deleted": True})

    async def cancel(request: web.Request) -> web.Response:
        return json_response(responses.cancel(request.match_info["response_id"]))

    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", get)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)


def _retry_after(resp: web.Response) -> dict[str, str] | None:
    value = resp.headers.get("Retry-After")
    return {"Retry-After": value} if value else None
