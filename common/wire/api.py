"""Request bodies of the client HTTP API (SGLang /generate and OpenAI), validated with pydantic.

Unknown top-level fields are ignored (OpenAI clients send many), except those that would change the
output and that Tandem does not implement (common/wire/unsupported.py): those are 400 errors naming the
field, and so are wrong types and out-of-range values. Types are strict ("2" is no integer, "false" or 1
no boolean): the router reads some fields too (stream, return_logprob, logprob_start_len, echo,
logprobs), and a value that meant one thing to it and another to the worker would split a request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.wire.body import dotted_path, parse_json_object
from common.wire.errors import InvalidRequest
from common.wire.migration import Migration
from common.wire.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from common.wire.structured_output import GENERATE_FIELDS, GrammarSpec, from_body
from common.wire.tools import ToolSet, parse_tools
from common.wire.unsupported import CHAT, COMPLETION, GENERATE, GENERATE_SAMPLING, reject_best_of, reject_unsupported

INSTANCE_HEADER = "X-Tandem-Instance-Id"  # a PD server's /health names its transfer instance (routers pass it on)
# a decode's /health with --kv-load-failure-policy recompute: it computes a prompt whose KV did not arrive itself,
# so a router lets its requests run on when their prefill fails
RECOMPUTE_HEADER = "X-Tandem-KV-Recompute"
ROLE_HEADER = "X-Tandem-Role"  # ... and its role, which a role switch changes (routers follow it)
BOOTSTRAP_HEADER = "X-Tandem-Bootstrap"  # ... and a prefill's bootstrap registry, HOST:PORT
# Where a PD request's prompt is computed (docs/placement.md), the router's body field `pd_placement`: on a prefill
# that sends the KV of the prompt past the decode's cached prefix (remote_suffix, the default), of the whole prompt
# (remote_full: the decode ignores its cache), or on the decode itself (local: no prefill, no bootstrap fields).
PLACEMENTS = ("remote_suffix", "remote_full", "local")


@dataclass(frozen=True)
class Rendezvous:
    """How one PD request finds its peer: the bootstrap registry the prefill registered with, the prefill
    instance in it (None: the registry's only prefill) and the room both halves share."""

    bootstrap_host: str | None
    bootstrap_port: int | None
    room_id: int
    prefill_instance_id: str | None = None

    def for_choice(self, index: int) -> Rendezvous:
        """Choice `index` of an n > 1 request gets room + index; prefill and decode derive the same."""
        return replace(self, room_id=(self.room_id + index) % 2**63)


def rendezvous_problem(mode: str, rendezvous: Rendezvous | None, placement: str | None = None) -> str | None:
    """Why a server in `mode` cannot serve a request with this rendezvous and `pd_placement`, or None: a prefill
    or decode server serves only what a router paired (it added the bootstrap fields), or, a decode, what it
    is asked to prefill itself (`pd_placement` local, without them)."""
    if placement == "local" and mode == "prefill":
        return "pd_placement local asks a decode server to prefill the prompt itself; this is a prefill server"
    if placement == "local" and mode == "decode":
        return "pd_placement local takes no bootstrap fields: the decode computes the prompt" if rendezvous else None
    if mode in ("prefill", "decode") and rendezvous is None:
        return (
            f"a {mode} server needs bootstrap_room (and the other bootstrap fields): send requests through the router"
        )
    return None


class PDFields(BaseModel):
    """Injected by the router (SGLang's PD convention, plus the prefill's instance id, and `migration` when it
    may move the request to another pair: common/wire/migration.py); absent in monolithic use."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    bootstrap_host: str | None = Field(None, max_length=255)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, lt=2**63)
    prefill_instance_id: str | None = Field(None, min_length=1, max_length=128)
    migration: Migration | None = None
    data_parallel_rank: int | None = Field(None, ge=0, lt=2**16)  # SGLang's: the DP rank to run on (DP attention)
    pd_placement: Literal[PLACEMENTS] | None = None  # type: ignore[valid-type]

    @property
    def rendezvous(self) -> Rendezvous | None:
        if self.bootstrap_room is None:
            return None
        return Rendezvous(self.bootstrap_host, self.bootstrap_port, self.bootstrap_room, self.prefill_instance_id)


class GenerateRequest(PDFields):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    logprob_start_len: int = Field(-1, ge=-1)  # checked against the prompt's length by common/http/serving.py
    rid: str | None = Field(None, max_length=256)
    priority: int | None = Field(None, ge=-(2**31), lt=2**31)  # needs --enable-priority-scheduling
    lora_path: str | None = Field(None, max_length=256)  # SGLang's: the adapter's name (--lora-paths), None: the base

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        reject_unsupported(data, GENERATE)
        if isinstance(data, dict):
            reject_unsupported(data.get("sampling_params"), GENERATE_SAMPLING, "sampling_params.")
        return data

    def grammar_spec(self) -> GrammarSpec | None:
        """The constraint of sampling_params' json_schema, regex, ebnf or structural_tag (one at most)."""
        fields = {k: getattr(self.sampling_params, k) for k in GENERATE_FIELDS}
        return from_body(fields, "sampling_params.", GENERATE_FIELDS)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class OpenAIBase(PDFields):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    logit_bias: Any = None  # checked by SamplingParams (errors name logit_bias)
    min_tokens: int = Field(0, ge=0)  # vLLM's extension: SGLang's min_new_tokens
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's extension: SGLang's no_stop_trim
    user: str | None = None
    priority: int | None = Field(None, ge=-(2**31), lt=2**31)  # needs --enable-priority-scheduling
    # constrained decoding: OpenAI's response_format, vLLM's guided_* and structured_outputs, SGLang's names
    # (checked by common/wire/structured_output.py, which gives the errors their field names)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit null for an optional field means unset, as in OpenAI's API (clients send
        `"temperature": null`)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def grammar_spec(self) -> GrammarSpec | None:
        """The one constraint the request sets, or None."""
        return from_body(self.model_dump(include=CONSTRAINT_FIELDS))

    def sampling_params(self, max_new_tokens: int, max_tokens_param: str = "max_tokens") -> SamplingParams:
        """The engine's parameters; values OpenAI's ranges allow but the engine does not are a 400
        naming the request's own field (`max_tokens_param` for the engine's max_new_tokens)."""
        fields = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "n": self.n,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.include_stop_str_in_output,
            "logit_bias": self.logit_bias,
        }
        rename = {
            "max_new_tokens": max_tokens_param,
            "min_new_tokens": "min_tokens",
            "no_stop_trim": "include_stop_str_in_output",
        }
        try:
            return SamplingParams(**fields)
        except ValidationError as e:
            raise invalid_request(e, fields, rename=rename) from None


CONSTRAINT_FIELDS = {
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "json_schema",
    "regex",
    "ebnf",
}


class CompletionRequest(OpenAIBase):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        reject_unsupported(data, COMPLETION)
        reject_best_of(data)
        return data


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as the API returned them
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: tool call arguments as objects (Qwen's, Llama's, ...)."""
        role = "system" if self.role == "developer" else self.role  # OpenAI's new name; templates know system
        out: dict[str, Any] = {"role": role, "content": self.content or ""}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return out

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        if isinstance(v, list):
            if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in v):
                raise ValueError("only text content parts are supported")
            return "".join(p["text"] for p in v)
        return v


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {**call, "function": fn}


# apply_chat_template arguments the server itself passes (or that would change what it returns)
TEMPLATE_ARGS_SET_BY_SERVER = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatCompletionRequest(OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False  # OpenAI's API takes null: none
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # extra variables for the model's chat template (vLLM's and SGLang's), e.g. Qwen3's enable_thinking
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=32)
    tools: Any = None  # checked by common/wire/tools.py
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    def tool_set(self) -> ToolSet:
        return parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        reject_unsupported(data, CHAT)
        return data

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs: logprobs must be true when top_logprobs is given", param="top_logprobs")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or ()) & TEMPLATE_ARGS_SET_BY_SERVER)
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set here: the server sets them")
        return v


M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, model: type[M]) -> M:
    """Bytes of an HTTP body -> validated model, or InvalidRequest naming the problem."""
    return validate(parse_json_object(raw), model)


def validate(data: dict[str, Any], model: type[M]) -> M:
    """A parsed JSON body -> validated model, or InvalidRequest naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise invalid_request(e, data) from None


def invalid_request(e: ValidationError, data: Any, rename: dict[str, str] | None = None) -> InvalidRequest:
    """The first error of a pydantic validation as a 400 naming the field as the client spelled it."""
    err = e.errors()[0]
    path = _client_path(data, err["loc"], missing=err["type"] == "missing")
    if path and rename and path[0] in rename:
        path = (rename[path[0]], *path[1:])
    field = dotted_path(path) or "body"
    return InvalidRequest(f"{field}: {err['msg']}", param=field)


def _client_path(data: Any, loc: tuple[Any, ...], missing: bool) -> tuple[Any, ...]:
    """`loc` without pydantic's union-member tags (`prompt.str`, `content.list[...]`): keep the steps
    that exist in the client's data, and the last step of a missing field."""
    path: list[Any] = []
    for i, step in enumerate(loc):
        if isinstance(data, dict) and step in data:
            data = data[step]
        elif isinstance(data, list) and isinstance(step, int) and 0 <= step < len(data):
            data = data[step]
        elif missing and i == len(loc) - 1:
            pass
        else:
            continue
        path.append(step)
    return tuple(path)
