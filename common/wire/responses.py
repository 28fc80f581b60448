"""OpenAI's Responses API request (`POST /v1/responses`) as the chat completion that serves it.

The Responses API is a translation layer over the chat path (every server's and the router's): a request
becomes one chat completion body (`to_chat`), whose answer or stream becomes the response
(common/wire/responses_output.py, common/wire/responses_stream.py). So tools, structured outputs, the
reasoning parser, migration and speculative decoding compose as they do for chat.

    Responses                               chat completions
    instructions                            a first system message (not carried to a continuation, as OpenAI)
    input: string | items                   messages: user text; message items (input_text / output_text
                                            parts); function_call -> an assistant's tool_calls;
                                            function_call_output -> a tool message (for a call seen before)
    previous_response_id                    its input items and output items go first (the stored history)
    max_output_tokens, temperature, top_p   max_completion_tokens, temperature, top_p
    tools (function), tool_choice,          tools, tool_choice, parallel_tool_calls (OpenAI's flat function
      parallel_tool_calls                   tool as chat's nested one); hosted tools are a 400 naming them
    text.format                             response_format (json_schema, json_object, text)
    stream                                  stream with stream_options.include_usage

Errors the chat path raises name its fields; `responses_param` names the Responses field instead.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.wire.api import invalid_request
from common.wire.errors import InvalidRequest
from common.wire.unsupported import reject_unsupported

HOSTED_TOOLS = (
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "computer",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
)
# fields that would change the answer and that Tandem does not implement (absent or these values: fine)
UNSUPPORTED = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
}
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """The fields Tandem reads; other fields are ignored unless UNSUPPORTED names them."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=512)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = Field(None, max_length=256)
    seed: int | None = None  # vLLM's extension, passed on

    @classmethod
    def parse(cls, data: Any) -> ResponsesRequest:
        """A validated request (a dict already parsed from JSON), or InvalidRequest naming the field."""
        reject_unsupported(data, UNSUPPORTED)
        data = {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data
        try:
            return cls.model_validate(data)
        except Exception as e:  # pydantic's ValidationError, as the chat bodies' errors
            raise invalid_request(e, data) from None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        if not v:
            raise ValueError("give a string or at least one item")
        return v

    def format(self) -> dict[str, Any] | None:
        """text.format as chat's response_format (None: plain text)."""
        if (self.text or {}).get("verbosity") not in (None, "medium"):  # as chat's verbosity
            raise InvalidRequest("text.verbosity is not supported by this server", param="text.verbosity")
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise InvalidRequest("text.format.type: give text, json_object or json_schema", param="text.format.type")
        if fmt["type"] != "json_schema":
            return {"type": fmt["type"]}
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format.schema: give the JSON schema object", param="text.format.schema")
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' function tools ({type, name, parameters, ...}) as chat's ({type, function: {...}})."""
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind != "function":
            what = f"the hosted tool {kind!r}" if kind in HOSTED_TOOLS else f"tool type {kind!r}"
            raise InvalidRequest(
                f"tools[{i}].type: {what} is not supported by this server; give function tools",
                param=f"tools[{i}].type",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    """ "auto" / "none" / "required" as they are; {"type": "function", "name"} as chat's named choice."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools":
        raise InvalidRequest("tool_choice: allowed_tools is not supported by this server", param="tool_choice")
    raise InvalidRequest(
        'tool_choice: give "none", "auto", "required" or {"type": "function", "name": ...}', param="tool_choice"
    )


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return req.input


def to_messages(items: list[dict[str, Any]], first_new: int) -> list[dict[str, Any]]:
    """Chat messages of the conversation's items; items from `first_new` on are the request's own `input`
    (errors name them input[i]), those before came from previous responses."""
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    for n, item in enumerate(items):
        where = f"input[{n - first_new}]" if n >= first_new else "previous_response_id"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_call_output(item, where, calls))
        elif kind != "reasoning":  # a model's earlier thinking: not shown to it again (as chat templates drop it)
            raise InvalidRequest(
                f"{where}.type: {kind!r} is not one of message, function_call, function_call_output, reasoning",
                param=f"{where}.type",
            )
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role: give one of {', '.join(ROLES)}", param=f"{where}.role")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in (*TEXT_PARTS, "refusal"):
                kind = part.get("type") if isinstance(part, dict) else None
                raise InvalidRequest(
                    f"{where}.content[{j}].type: {kind!r}: only text parts (input_text, output_text) are supported",
                    param=f"{where}.content[{j}].type",
                )
        content = "".join(p.get("text") or p.get("refusal") or "" for p in content)
    if not isinstance(content, str):
        raise InvalidRequest(f"{where}.content: give a string or a list of text parts", param=f"{where}.content")
    return {"role": role, "content": content}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise InvalidRequest(f"{where}.{key}: give a string", param=f"{where}.{key}")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _call_output(item: dict[str, Any], where: str, calls: set[str]) -> dict[str, Any]:
    cid, output = item.get("call_id"), item.get("output")
    if cid not in calls:
        raise InvalidRequest(
            f"{where}.call_id: no function_call with call_id {cid!r} comes before this output", param=f"{where}.call_id"
        )
    if isinstance(output, list):  # output parts: their text
        output = "".join(p.get("text") or "" for p in output if isinstance(p, dict))
    if not isinstance(output, str):
        raise InvalidRequest(f"{where}.output: give a string", param=f"{where}.output")
    return {"role": "tool", "tool_call_id": cid, "content": output}


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion body that serves `req`, after the conversation `history` (a previous response's
    input and output items)."""
    messages = to_messages(history + input_items(req), len(history))
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": req.format(),
        "user": req.user,
        "seed": req.seed,
    }
    if req.stream:
        fields |= {"stream": True, "stream_options": {"include_usage": True}}
    return {k: v for k, v in fields.items() if v is not None}


CHAT_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema.strict": "text.format.strict",
}


def responses_param(param: str | None) -> str | None:
    """The Responses field of an error the chat path raised about its own field."""
    if param is None:
        return None
    if param in CHAT_PARAMS:
        return CHAT_PARAMS[param]
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param
