"""A chat completion's SSE stream as the Responses API's typed events, in OpenAI's order, each with its
`sequence_number`:

    response.created, response.in_progress
    per output item, in the order the model writes them (reasoning, then the message, then each call):
      response.output_item.added
      reasoning:      response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                      response.content_part.done
      message:        response.content_part.added, response.output_text.delta..., response.output_text.done,
                      response.content_part.done
      function_call:  response.function_call_arguments.delta..., response.function_call_arguments.done
      response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed (an error event)

`SSETranslator` turns the chat stream's bytes (whole events, `data: [DONE]` last) into these events' bytes;
the router and the servers feed it what the chat path streams.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from common.wire.responses_output import Shell, call_item, item_id, message_item, reasoning_item, text_part

PARTS = {"reasoning": "reasoning_text", "message": "output_text"}
DELTAS = {"reasoning": "response.reasoning_text", "message": "response.output_text"}
CANCEL_POLL_S = 0.2


class ResponsesStream:
    """The events of one response, fed chat chunks (dicts) as they come."""

    def __init__(self, shell: Shell):
        self.shell, self.seq = shell, 0
        self.output: list[dict[str, Any]] = []  # the items so far (the open one last)
        self.kind: str | None = None  # the open item's: reasoning | message | call
        self.text = ""  # its text or arguments so far
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.final: dict[str, Any] | None = None  # the response once it ended

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.shell.response([], "in_progress")
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def chunk(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in data:
            return self.failed(data["error"])
        out: list[dict[str, Any]] = []
        for choice in data.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
        if data.get("usage"):
            self.usage = data["usage"]
        return out

    def end(self) -> list[dict[str, Any]]:
        out = self._close()
        status = "incomplete" if self.finish == "length" else "completed"
        self.final = self.shell.response(self.output, status, self.usage)
        return out + [self.event(f"response.{status}", response=self.final)]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        err = {"code": "server_error", "message": error.get("message", "the request failed")}
        self.final = self.shell.response(self.output, "failed", self.usage, err)
        return out + [self.event("response.failed", response=self.final)]

    def cancelled(self) -> list[dict[str, Any]]:
        """The end of a response cancelled while it ran (POST /v1/responses/{id}/cancel)."""
        out = self._close()
        self.final = self.shell.response(self.output, "cancelled", self.usage)
        return out + [self.event("response.failed", response=self.final)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _open(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.kind, self.text = kind, ""
        self.output.append(item)
        out.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        if kind in PARTS:
            part = text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def _text(self, kind: str, piece: str) -> list[dict[str, Any]]:
        out = []
        if self.kind != kind:
            item = (
                reasoning_item("", status="in_progress")
                if kind == "reasoning"
                else message_item(None, None, "in_progress")
            )
            out += self._open(kind, item)
        self.text += piece
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(DELTAS[kind] + ".delta", **self._where(), content_index=0, delta=piece, **extra))
        return out

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out, fn = [], call.get("function") or {}
        if call.get("id"):  # a call's first chunk: its id and name
            out += self._open("call", call_item(call["id"], fn.get("name", ""), "", item_id("fc"), "in_progress"))
        if fn.get("arguments"):
            self.text += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=fn["arguments"]))
        return out

    def _close(self) -> list[dict[str, Any]]:
        """The open item's done events; the item as it ended goes into the output."""
        kind, text = self.kind, self.text
        if kind is None:
            return []
        self.kind, where, item = None, self._where(), self.output[-1]
        out = []
        if kind == "call":
            item = item | {"arguments": text, "status": "completed"}
            out.append(self.event("response.function_call_arguments.done", **where, arguments=text))
        else:
            part = text_part(text) if kind == "message" else {"type": "reasoning_text", "text": text}
            extra = {"logprobs": []} if kind == "message" else {}
            out.append(self.event(DELTAS[kind] + ".done", **where, content_index=0, text=text, **extra))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item = item | {"content": [part], "status": "completed"}
        self.output[-1] = item
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return out


def sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


class SSETranslator:
    """Chat SSE bytes (whole events) in, Responses SSE bytes out; `on_end` gets the final response once. After
    `cancel_requested` is set, the next feed ends the stream as cancelled (its caller stops reading the chat
    stream: `ended`)."""

    def __init__(
        self, stream: ResponsesStream, on_end: Callable[[dict[str, Any]], None], poll: Callable[[], bool] | None = None
    ):
        """`poll`: whether another process asked to cancel (a router group's shared store), read at most every
        CANCEL_POLL_S."""
        self.stream, self.on_end, self.started = stream, on_end, False
        self.cancel_requested = False
        self.poll, self.polled = poll, time.monotonic()

    @property
    def ended(self) -> bool:
        return self.stream.final is not None

    def feed(self, data: bytes) -> bytes:
        payloads = [line[6:].strip() for line in data.split(b"\n") if line.startswith(b"data: ")]  # not traces
        chunks = [None if p == b"[DONE]" else json.loads(p) for p in payloads]
        events = [] if self.started else self._start(chunks)
        if self.poll is not None and time.monotonic() - self.polled >= CANCEL_POLL_S:
            self.polled = time.monotonic()
            self.cancel_requested = self.cancel_requested or self.poll()
        if self.cancel_requested and not self.ended:
            events += self.stream.cancelled()
            self.on_end(self.stream.final)
        for chunk in chunks:
            if self.ended:
                break  # nothing after the end
            events += self.stream.end() if chunk is None else self.stream.chunk(chunk)
            if self.ended:
                self.on_end(self.stream.final)
        return sse(events)

    def _start(self, chunks: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
        """The first events, naming the model the first chunk names."""
        self.started = True
        named = [c["model"] for c in chunks if c and c.get("model")]
        self.stream.shell.model = named[0] if named else self.stream.shell.model
        return self.stream.start()

    def snapshot(self, status: str) -> dict[str, Any]:
        """The response as far as it went, with `status`."""
        return self.stream.shell.response(self.stream.output, status, self.stream.usage)

    def abandon(self) -> None:
        """The end of a stream the chat path ended without an answer (the client left, no pair served it)."""
        if not self.ended:
            self.stream.final = self.snapshot("failed") | {
                "error": {"code": "server_error", "message": "the stream ended before the response did"}
            }
            self.on_end(self.stream.final)
