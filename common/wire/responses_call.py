"""One `POST /v1/responses` from its body to its end, whoever serves the chat completion under it (a server's
chat path, or the router's PD pairs): the conversation (the previous response's history, then the input), the
chat body, the response made of the chat answer or stream, the store, and one log line per response.
`Responses` is what an app keeps: the store and the responses running in this process (for cancel).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from common.wire.errors import InvalidRequest, TandemError
from common.wire.responses import ResponsesRequest, input_items, responses_param, to_chat
from common.wire.responses_output import Shell
from common.wire.responses_store import ResponsesStore
from common.wire.responses_stream import ResponsesStream, SSETranslator

log = logging.getLogger("tandem.responses")


class Responses:
    """An app's stored responses and its running ones (response id -> its stream's translator)."""

    def __init__(self, store: ResponsesStore):
        self.store = store
        self.running: dict[str, SSETranslator] = {}

    def cancel(self, rid: str) -> dict[str, Any]:
        """Cancel the running response `rid` (its stream ends at its next event); a 400 naming it when it is not
        running in this process (nor, in a router group, in progress in another)."""
        response = self.store.get(rid)
        translator = self.running.get(rid)
        if translator is None and self.store.shared and response["status"] == "in_progress":
            self.store.request_cancel(rid)  # another process of the group streams it
            return response | {"status": "cancelled"}
        if translator is None:
            raise InvalidRequest(
                f"response_id: {rid!r} is {response['status']} and not running in this process: only a response "
                "streaming here, with store, can be cancelled",
                param="response_id",
            )
        translator.cancel_requested = True
        return translator.snapshot("cancelled")


class ResponseCall:
    def __init__(self, body: dict[str, Any], responses: Responses, model: str = ""):
        self.req = ResponsesRequest.parse(body)
        self.responses = responses
        rid = self.req.previous_response_id
        history = responses.store.history(rid) if rid else []
        self.items = history + input_items(self.req)
        self.chat = to_chat(self.req, history)
        self.shell = Shell(self.req, model=model)
        self.start = time.monotonic()

    @property
    def stored(self) -> bool:
        return self.req.store is not False

    def answer(self, chat_answer: dict[str, Any]) -> dict[str, Any]:
        """The response of the chat completion's JSON answer."""
        response = self.shell.from_chat(chat_answer)
        self.end(response)
        return response

    def translator(self) -> SSETranslator:
        """The stream's translator; a stored response is stored in progress now, and may be cancelled till it
        ends."""
        store, rid = self.responses.store, self.shell.id
        poll = (lambda: store.cancel_requested(rid)) if self.stored and store.shared else None
        translator = SSETranslator(ResponsesStream(self.shell), self.end, poll)
        if self.stored:
            self.responses.store.put(self.shell.response([], "in_progress"), self.items)
            self.responses.running[self.shell.id] = translator
        return translator

    def end(self, response: dict[str, Any]) -> None:
        self.responses.running.pop(response["id"], None)
        if self.stored:
            self.responses.store.put(response, self.items)
        usage = response.get("usage") or {}
        log.info(
            "response %s: %s, %d items in, %s out, %d+%d tokens (%d cached), %.1f ms",
            response["id"],
            response["status"],
            len(self.items),
            ",".join(item["type"] for item in response["output"]) or "nothing",
            usage.get("input_tokens", 0),
            usage.get("output_tokens", 0),
            (usage.get("input_tokens_details") or {}).get("cached_tokens", 0),
            1000 * (time.monotonic() - self.start),
        )


def renamed(e: TandemError) -> TandemError:
    """An error the chat path raised, naming the Responses field instead of the chat one."""
    body = responses_error(e.to_dict())["error"]
    e.param, e.message = body["param"], body["message"]
    return e


def responses_error(body: dict[str, Any]) -> dict[str, Any]:
    """A chat path's error body, naming the Responses field instead of the chat one."""
    err = body.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("param"), str):
        return body
    old, new = err["param"], responses_param(err["param"])
    message = err.get("message", "")
    if message.startswith(old):
        message = new + message[len(old) :]
    return {"error": err | {"param": new, "message": message}}
