"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, and the constraint they put on the output.

    tool_choice          the output                                         how it becomes message.tool_calls
    none (or no tools)   free text; the template is not given the tools     none
    auto (the default)   free text, which may hold calls in the model's     --tool-call-parser (common/http/tool_parsers.py)
                         own format
    required             a JSON array of {"name", "parameters"} objects,    parsed as JSON
                         one of the tools' schemas each (vLLM's)
    {"type": "function", the function's arguments: its parameters' schema  the output is the arguments
     "function": {name}}

`parallel_tool_calls: false` allows one call (required: maxItems 1; auto: the first call is kept).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.wire.errors import InvalidRequest
from common.wire.structured_output import GrammarSpec, canonical_json

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "function"
    function: Function


class ToolSet(BaseModel):
    """A request's tools, how they may be called and what that constrains."""

    model_config = ConfigDict(frozen=True)
    tools: list[Tool] = Field(default_factory=list)
    choice: str = "none"  # none | auto | required | named
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the model sees the tools and its output may hold calls."""
        return bool(self.tools) and self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template renders (transformers' apply_chat_template(tools=...))."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.active else None

    def constraint(self) -> GrammarSpec | None:
        """The JSON schema of a required or named choice, as vLLM builds it; None for auto and none."""
        if self.choice == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.named)
            return GrammarSpec("json_schema", canonical_json(_params(fn), "tools"), "tool_choice")
        if self.choice == "required":
            items = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": {"$ref": f"#/$defs/{_def_name(i)}"},
                    },
                    "required": ["name", "parameters"],
                }
                for i, t in enumerate(self.tools)
            ]
            defs = {_def_name(i): _rebased(_params(t.function), _def_name(i)) for i, t in enumerate(self.tools)}
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "$defs": defs}
            if not self.parallel:
                schema["maxItems"] = 1
            return GrammarSpec("json_schema", canonical_json(schema, "tools"), "tool_choice")
        return None


def _params(fn: Function) -> dict[str, Any]:
    return fn.parameters if fn.parameters else {"type": "object", "properties": {}}


def _def_name(i: int) -> str:
    return f"tool{i}"


def _rebased(schema: Any, name: str) -> Any:
    """A tool's parameters moved to the root's `$defs/name` (required's array schema): each local `$ref` ("#",
    "#/$defs/Address", "#/definitions/...") points into it again, so nested models and recursion still resolve
    (xgrammar follows JSON pointers through object keys only, not anyOf's array indices)."""
    if isinstance(schema, list):
        return [_rebased(v, name) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebased(v, name) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = f"#/$defs/{name}{ref[1:]}"
    return out


def parse_tools(tools: Any, tool_choice: Any, parallel: Any) -> ToolSet:
    """The request's tool fields checked: a 400 naming the field for anything unusable."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice: give tools to choose from", param="tool_choice")
        return ToolSet()
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools: give a list of at most {MAX_TOOLS} tools", param="tools")
    parsed = []
    for i, raw in enumerate(tools):
        try:
            tool = Tool.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise InvalidRequest(f"tools[{i}].{where}: {err['msg']}", param=f"tools[{i}].{where}") from None
        _check_tool(tool, i)
        parsed.append(tool)
    names = [t.function.name for t in parsed]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: two tools have the same name", param="tools")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls: give a boolean", param="parallel_tool_calls")
    choice, named = _choice(tool_choice, names)
    return ToolSet(tools=parsed, choice=choice, named=named, parallel=parallel is not False)


def _check_tool(tool: Tool, i: int) -> None:
    if tool.type != "function":
        raise InvalidRequest(f"tools[{i}].type: only function tools are supported", param=f"tools[{i}].type")
    if not NAME.match(tool.function.name):
        raise InvalidRequest(
            f"tools[{i}].function.name: 1 to 64 letters, digits, '_', '.' or '-'", param=f"tools[{i}].function.name"
        )
    if tool.function.parameters is not None:
        json.dumps(tool.function.parameters)


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type", "function") != "function" if isinstance(tool_choice, dict) else True:
        raise InvalidRequest(
            'tool_choice: give "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if not isinstance(name, str):
        raise InvalidRequest("tool_choice.function.name: give the name of a tool", param="tool_choice")
    if name not in names:
        raise InvalidRequest(f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    return "named", name
