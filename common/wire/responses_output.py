"""A chat completion's answer as OpenAI's Response object: its output items (reasoning, message,
function_call), status and usage, with the request's settings echoed as OpenAI echoes them.

    chat                                  response
    message.reasoning_content             a reasoning item (its text as one reasoning_text part)
    message.content                       a message item with one output_text part
    message.tool_calls[i]                 a function_call item (call_id: the call's id)
    finish_reason length                  status incomplete, incomplete_details.reason max_output_tokens
    usage                                 input_tokens (cached_tokens), output_tokens, total_tokens
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.wire.responses import ResponsesRequest


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, rid: str | None = None, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"id": rid or item_id("rs"), "type": "reasoning", "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, mid: str | None = None, status: str = "completed") -> dict[str, Any]:
    content = [text_part(text)] if text is not None else []
    return {"id": mid or item_id("msg"), "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(call_id: str, name: str, arguments: str, fid: str | None = None, status: str = "completed") -> dict:
    return {
        "id": fid or item_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message as output items, in the order the model wrote them."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or ():
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's usage as the Responses API's (the prompt's cached tokens: the prefix cache's, the decode's on PD)."""
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


@dataclass
class Shell:
    """What a response says besides its output: the request's settings, its id and creation time."""

    req: ResponsesRequest
    id: str = field(default_factory=lambda: item_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    model: str = ""

    def response(
        self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None = None, error: Any = None
    ) -> dict[str, Any]:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.model or req.model or "",
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning,
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": response_usage(usage),
            "user": req.user,
        }

    def from_chat(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The whole response of a chat completion's JSON answer (its first choice)."""
        choice = answer["choices"][0]
        status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
        self.model = answer.get("model") or self.model
        return self.response(output_items(choice["message"]), status, answer.get("usage"))
