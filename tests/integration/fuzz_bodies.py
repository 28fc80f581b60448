"""What the HTTP fuzz (test_fuzz_http.py) sends the client API: hypothesis strategies for arbitrary JSON,
valid bodies of each endpoint with fields made wrong-typed, out of range or at the edges of their declared
bounds (read from the pydantic models), and raw bytes that are no JSON object."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from common.wire.api import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerateRequest, StreamOptions
from common.wire.responses import ResponsesRequest
from common.wire.sampling_params import SamplingParams

VOCAB = 49152  # the built-in tokenizer's: token ids past it are out of range
BASES: dict[str, dict[str, Any]] = {
    "/generate": {"text": "Hello there", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    "/v1/completions": {"prompt": "Hello there", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2},
    "/v1/responses": {"input": "Hello there", "max_output_tokens": 2},
}
ENDPOINTS = list(BASES)


def fields(model: type[BaseModel], prefix: str = "") -> dict[str, FieldInfo]:
    return {prefix + name: info for name, info in model.model_fields.items()}


FIELDS: dict[str, dict[str, FieldInfo]] = {
    "/generate": fields(GenerateRequest) | fields(SamplingParams, "sampling_params."),
    "/v1/completions": fields(CompletionRequest) | fields(StreamOptions, "stream_options."),
    "/v1/chat/completions": fields(ChatCompletionRequest)
    | fields(ChatMessage, "messages.0.")
    | fields(StreamOptions, "stream_options."),
    "/v1/responses": fields(ResponsesRequest),
}
ALL_FIELDS = sorted({p.rsplit(".", 1)[-1] for paths in FIELDS.values() for p in paths})


def bound_values(info: FieldInfo) -> list[Any]:
    """Each numeric bound the model declares, and values just inside and just outside it."""
    values: list[Any] = []
    for constraint in info.metadata:
        for name in ("ge", "gt", "le", "lt"):
            bound = getattr(constraint, name, None)
            if isinstance(bound, int):
                values += [bound - 1, bound, bound + 1]
            if isinstance(bound, (int, float)):
                values += [float(bound), bound - 1e-9, bound + 1e-9, bound / 2, bound * 2]
    return values


EDGE_NUMBERS = [
    0,
    -1,
    1,
    2,
    16,
    17,
    20,
    21,
    255,
    256,
    257,
    VOCAB - 1,
    VOCAB,
    65535,
    65536,
    2**31,
    -(2**31),
    2**53 + 1,
    2**63 - 1,
    2**63,
    -(2**63),
    -(2**63) - 1,
    2**64,
    10**30,
    -(10**30),
    0.0,
    -0.0,
    0.5,
    1.5,
    2.0000001,
    -2.0000001,
    1e-5,
    9.9e-6,
    1e-40,
    5e-324,
    1e-320,
    1e308,
    -1e308,
]
TRICKY_STRINGS = [
    "",
    " ",
    "NaN",
    "nan",
    "Infinity",
    "-Infinity",
    "inf",
    "1e309",
    "-0",
    "0x10",
    "1_000",
    "true",
    "null",
    "[]",
    "{}",
    "\x00",
    "\ud800",
    "a\udfffb",
    "é",
    "日本語",
    "🙂🙂",
    "<|im_end|>",
    "<|endoftext|>",
    "user",
    "text",
    "x" * 300,
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(EDGE_NUMBERS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(TRICKY_STRINGS),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.sampled_from(ALL_FIELDS), inner, max_size=4)
    ),
    max_leaves=12,
)
token_lists = st.lists(st.integers(0, VOCAB - 1) | st.sampled_from([-1, VOCAB, 2**63, 10**30]), max_size=6)
# in-range values too, so that bodies get through validation and the engine runs odd but legal requests
plausible = st.one_of(
    st.booleans(),
    st.integers(-3, 300),
    st.floats(-3, 3),
    st.sampled_from(["a", "\n", "Hello", " the"]),
    st.lists(st.sampled_from(["a", "\n", ",", " the"]), max_size=3),
)
nasty_values = st.one_of(
    scalars,
    plausible,
    token_lists,
    json_values,
    st.sampled_from([[], {}, [[]], [{}], {"type": "text"}, {"include_usage": True}]),
)


def encode(value: Any) -> bytes:
    """JSON as Python writes it: NaN/Infinity literals and \\ud800 escapes included."""
    return json.dumps(value).encode()


def set_path(body: dict[str, Any], path: str, value: Any) -> None:
    """body[a][b] = value for the path "a.b" ("messages.0.role": the first message); a path through a
    value that an earlier replacement made a scalar is skipped."""
    *parents, last = path.split(".")
    node: Any = body
    for step in parents:
        if isinstance(node, dict):
            node = node.setdefault(step, {})
        elif isinstance(node, list) and node:
            node = node[0]
        else:
            return
    value = copy.deepcopy(value)  # strategies share their constants: never alias them into a body
    if isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list) and node:
        node[0] = value


@st.composite
def broken_bodies(draw) -> tuple[str, bytes]:
    """A valid body of one endpoint with one to three of its fields replaced by nasty values."""
    endpoint = draw(st.sampled_from(ENDPOINTS))
    body = copy.deepcopy(BASES[endpoint])
    for path in draw(st.lists(st.sampled_from(sorted(FIELDS[endpoint])), min_size=1, max_size=3, unique=True)):
        bounds = bound_values(FIELDS[endpoint][path])
        set_path(body, path, draw(st.sampled_from(bounds) | nasty_values if bounds else nasty_values))
    return endpoint, encode(body)


def legal_ish_values(info: FieldInfo) -> st.SearchStrategy[Any]:
    """Values a client could mean: both booleans, numbers around the declared bounds, short strings."""
    if info.annotation is bool:
        return st.booleans()
    bounds = bound_values(info)
    return st.sampled_from(bounds) if bounds else plausible


@st.composite
def edge_bodies(draw) -> tuple[str, bytes]:
    """A valid body of one endpoint with one to four fields at or just past the edges of their ranges."""
    endpoint = draw(st.sampled_from(ENDPOINTS))
    body = copy.deepcopy(BASES[endpoint])
    for path in draw(st.lists(st.sampled_from(sorted(FIELDS[endpoint])), min_size=1, max_size=4, unique=True)):
        set_path(body, path, draw(legal_ish_values(FIELDS[endpoint][path])))
    return endpoint, encode(body)


@st.composite
def raw_bodies(draw) -> tuple[str, bytes]:
    """Bytes that are no JSON object: random, truncated, invalid UTF-8, or JSON Python cannot decode."""
    endpoint = draw(st.sampled_from(ENDPOINTS))
    valid = encode(BASES[endpoint])
    raw = draw(
        st.one_of(
            st.binary(max_size=64),
            st.integers(0, len(valid) - 1).map(lambda cut: valid[:cut]),  # truncated JSON
            st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]).map(
                lambda bad: valid.replace(b"Hello", b"Hel" + bad)
            ),
            st.sampled_from(
                [
                    b"[" * 5000 + b"]" * 5000,
                    b'{"a":' * 3000 + b"1" + b"}" * 3000,
                    b'{"max_tokens": ' + b"9" * 5000 + b"}",
                    b'{"text": "\\ud800"}',
                    b'{"\\udfff": 1}',
                    b"",
                    b"null",
                    b"1e999",
                    b"\xef\xbb\xbf{}",
                ]
            ),
        )
    )
    return endpoint, raw
