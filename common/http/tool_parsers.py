"""Tool calls in a model's own text format (`--tool-call-parser`, SGLang's and vLLM's names), for
`tool_choice: auto`. Each parser finds where calls may start (so a stream holds that text back instead of
sending it as content) and turns the text into (content, calls). Text that does not parse whole stays
content, as vLLM does: a call is never half-reported.

| parser | families | format |
| --- | --- | --- |
| hermes, qwen25 | Hermes, Qwen2.5, Qwen3 | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated |
| llama3 | Llama 3.x | `<|python_tag|>`? then `{"name": ..., "parameters": {...}}`, `;`-separated |
| mistral | Mistral | `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` |
| deepseekv3 | DeepSeek-V3 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...` |
| pythonic | Llama 4, others | `[get_weather(city="Paris"), ...]` |
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

Call = tuple[str, str]  # (function name, arguments as JSON text)


@dataclass(frozen=True)
class ToolParser:
    name: str
    start: str  # text that starts the calls (streams hold it back); "" for formats that start with the text
    needs_special_tokens: bool = False  # the markers are special tokens: the detokenizer must keep them

    def start_index(self, text: str) -> int | None:
        """Where the calls start in `text` (None: not yet); a stream holds back what follows."""
        if self.start:
            i = text.find(self.start)
            return i if i >= 0 else None
        stripped = text.lstrip()
        opener = "[" if self.name == "pythonic" else "{"
        starts = stripped.startswith(opener) or (self.name == "llama3" and stripped.startswith("<|python_tag|>"))
        return len(text) - len(stripped) if starts else None

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` could begin the start marker (held back while streaming)."""
        if not self.start:
            return len(text) if not text.strip() else 0  # whitespace only: the calls may still come
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-k:]):
                return k
        return 0

    def parse(self, text: str) -> tuple[str, list[Call]]:
        """(content, calls); the whole text as content when it holds no call that parses."""
        i = self.start_index(text)
        if i is None:
            return text, []
        try:
            calls = PARSE[self.name](text[i:])
        except (ValueError, SyntaxError, KeyError, TypeError, AttributeError):
            return text, []
        return (text[:i], calls) if calls else (text, [])


def _call(obj: dict, args_key: str = "arguments") -> Call:
    name, args = obj["name"], obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
    if not isinstance(name, str):
        raise TypeError("a tool name is a string")
    return name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _hermes(text: str) -> list[Call]:
    bodies = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL)
    return [_call(json.loads(b)) for b in bodies]


def _llama3(text: str) -> list[Call]:
    text = text.strip().removeprefix("<|python_tag|>").strip()
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(text):
        obj, end = decoder.raw_decode(text, i)
        calls.append(_call(obj, "parameters"))
        i = end
        while i < len(text) and text[i] in " \n\t;":
            i += 1
    return calls


def _mistral(text: str) -> list[Call]:
    body = text.split("[TOOL_CALLS]", 1)[1].strip()
    obj = json.loads(body)
    return [_call(o) for o in (obj if isinstance(obj, list) else [obj])]


DSV3_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(.*?)\n```json\n(.*?)\n```\s*<｜tool▁call▁end｜>", re.DOTALL
)


def _deepseekv3(text: str) -> list[Call]:
    calls = [(name.strip(), json.dumps(json.loads(args), ensure_ascii=False)) for name, args in DSV3_CALL.findall(text)]
    if not calls:
        raise ValueError("no complete call")
    return calls


def _pythonic(text: str) -> list[Call]:
    tree = ast.parse(text.strip(), mode="eval").body
    if not isinstance(tree, ast.List):
        raise ValueError("not a list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("a call by keyword arguments")
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


PARSE = {
    "hermes": _hermes,
    "qwen25": _hermes,
    "llama3": _llama3,
    "mistral": _mistral,
    "deepseekv3": _deepseekv3,
    "pythonic": _pythonic,
}
PARSERS = {
    "hermes": ToolParser("hermes", "<tool_call>"),
    "qwen25": ToolParser("qwen25", "<tool_call>"),
    "llama3": ToolParser("llama3", "", needs_special_tokens=True),
    "mistral": ToolParser("mistral", "[TOOL_CALLS]", needs_special_tokens=True),
    "deepseekv3": ToolParser("deepseekv3", "<｜tool▁calls▁begin｜>", needs_special_tokens=True),
    "pythonic": ToolParser("pythonic", ""),
}
