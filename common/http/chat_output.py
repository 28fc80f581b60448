"""A chat choice's text as OpenAI's message: reasoning split off (--reasoning-parser), tool calls found
(tool_choice and --tool-call-parser), and the finish reason `tool_calls` when there are any. The same
rules give the whole message (`message`) and a stream's deltas (`ChoiceStream`).

Streaming: reasoning and content go out as they come; text that may be a tool call is held back (from the
parser's start marker on; a named tool's arguments are streamed as they come), and the calls are sent
at the end, each as OpenAI does: a first chunk with its index, id, type, name and empty arguments, then
one with the arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from common.http.reasoning import ReasoningParser
from common.http.tool_parsers import Call, ToolParser
from common.wire.tools import ToolSet


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call(call: Call, cid: str | None = None) -> dict[str, Any]:
    return {"id": cid or call_id(), "type": "function", "function": {"name": call[0], "arguments": call[1]}}


@dataclass(frozen=True)
class ChatShape:
    """How one chat request's text becomes its message."""

    tools: ToolSet
    parser: ToolParser | None = None  # tool_choice auto's
    reasoning: ReasoningParser | None = None

    def split(self, text: str, final: bool) -> tuple[str, str]:
        return self.reasoning.split(text, final) if self.reasoning else ("", text)

    def calls(self, content: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of the answer after the thinking."""
        t = self.tools
        if not t.active:
            return content, []
        if t.choice == "named":
            return None, [(t.named, content)]
        if t.choice == "required":
            try:
                items = json.loads(content)
                calls = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]
            except (ValueError, TypeError, KeyError):
                return content, []
            return None, calls
        if self.parser is None:
            return content, []
        text, calls = self.parser.parse(content)
        calls = calls[:1] if not t.parallel else calls
        return (text if text.strip() else None) if calls else text, calls

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole message and its finish reason."""
        reasoning, content = self.split(text, final=True)
        content, calls = self.calls(content)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            msg["reasoning_content"] = reasoning or None
        if calls:
            msg["tool_calls"] = [tool_call(c) for c in calls]
        return msg, ("tool_calls" if calls and finish == "stop" else finish)


class ChoiceStream:
    """One choice's deltas: feed() each new piece of text, end() once it finished."""

    def __init__(self, shape: ChatShape):
        self.shape = shape
        self.text = ""
        self.sent_reasoning = self.sent_content = 0
        self.named_id: str | None = None

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        return self._deltas(final=False)

    def end(self, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        deltas = self._deltas(final=True)
        shape, tools = self.shape, self.shape.tools
        _, content = shape.split(self.text, final=True)
        if not tools.active or tools.choice == "named":
            named = tools.active and tools.choice == "named"
            return deltas, ("tool_calls" if named and finish == "stop" else finish)
        rest, calls = shape.calls(content)
        if not calls:  # what was held back was content after all
            deltas += [{"content": content[self.sent_content :]}] if content[self.sent_content :] else []
            return deltas, finish
        start = shape.parser.start_index(content) if tools.choice == "auto" else None
        if start is not None and start > self.sent_content and content[self.sent_content : start].strip():
            deltas.append({"content": content[self.sent_content : start]})
        for i, c in enumerate(calls):
            first = {"index": i, "id": call_id(), "type": "function", "function": {"name": c[0], "arguments": ""}}
            deltas += [{"tool_calls": [first]}, {"tool_calls": [{"index": i, "function": {"arguments": c[1]}}]}]
        return deltas, ("tool_calls" if finish == "stop" else finish)

    def _deltas(self, final: bool) -> list[dict[str, Any]]:
        reasoning, content = self.shape.split(self.text, final)
        out = []
        if len(reasoning) > self.sent_reasoning:
            out.append({"reasoning_content": reasoning[self.sent_reasoning :]})
            self.sent_reasoning = len(reasoning)
        safe = self._safe_content(content)
        if self.named_id is not None or (self.shape.tools.active and self.shape.tools.choice == "named"):
            return out + self._named_arguments(content)
        if safe > self.sent_content:
            out.append({"content": content[self.sent_content : safe]})
            self.sent_content = safe
        return out

    def _safe_content(self, content: str) -> int:
        """How much of the content may go out now: all of it unless tool calls may be in it."""
        tools, parser = self.shape.tools, self.shape.parser
        if not tools.active:
            return len(content)
        if tools.choice == "required":
            return 0
        if parser is None:
            return len(content)
        start = parser.start_index(content)
        return start if start is not None else len(content) - parser.held_back(content)

    def _named_arguments(self, content: str) -> list[dict[str, Any]]:
        """A named tool's arguments, streamed as they come (the whole answer is its arguments)."""
        out = []
        if self.named_id is None:
            self.named_id = call_id()
            first = {"index": 0, "id": self.named_id, "type": "function"}
            out.append({"tool_calls": [first | {"function": {"name": self.shape.tools.named, "arguments": ""}}]})
        if len(content) > self.sent_content:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": content[self.sent_content :]}}]})
            self.sent_content = len(content)
        return out
