"""The text side of tool calls and reasoning, without a model: each --tool-call-parser on its family's
format, the reasoning split whole and streamed piece by piece (every split point), the stream's deltas
putting back together what the whole message says, the tool_choice schemas, and the constraint fields'
400s."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel

from common.http.chat_output import ChatShape, ChoiceStream
from common.http.reasoning import PARSERS as REASONING
from common.http.tool_parsers import PARSERS
from common.wire.errors import InvalidRequest
from common.wire.structured_output import from_body
from common.wire.tools import parse_tools

ARGS = '{"city": "Paris"}'
FORMATS = {
    "hermes": f'Let me check.<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
    "qwen25": f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
    "llama3": f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}',
    "mistral": f'Let me check.[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}]',
    "deepseekv3": "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    f"```json\n{ARGS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "pythonic": '[get_weather(city="Paris")]',
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_parser_finds_its_familys_call(name):
    content, calls = PARSERS[name].parse(FORMATS[name])
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})]
    assert content == {"llama3": "", "pythonic": "", "qwen25": "Let me check.\n"}.get(name, "Let me check.")


@pytest.mark.parametrize("name", list(FORMATS))
def test_text_without_a_call_or_with_a_broken_one_stays_content(name):
    assert PARSERS[name].parse("The weather is fine.") == ("The weather is fine.", [])
    broken = FORMATS[name].replace('"Paris"', '"Paris').replace('city="Paris")', "city=Paris(")
    assert PARSERS[name].parse(broken) == (broken, [])


def test_hermes_finds_parallel_calls():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    assert PARSERS["hermes"].parse(text)[1] == [("a", "{}"), ("b", '{"x": 1}')]


@pytest.mark.parametrize(
    "parser,text,want",
    [
        ("deepseek-r1", "<think>a</think>b", ("a", "b")),
        ("deepseek-r1", "a</think>\n\nb", ("a", "b")),  # its template opened the thinking
        ("deepseek-r1", "still thinking", ("still thinking", "")),
        ("qwen3", "<think>a</think>b", ("a", "b")),
        ("qwen3", "no thinking here", ("", "no thinking here")),
    ],
)
def test_reasoning_split(parser, text, want):
    assert REASONING[parser].split(text, final=True) == want


def shapes() -> dict[str, ChatShape]:
    auto = parse_tools([WEATHER], "auto", None)
    return {
        "reasoning+hermes": ChatShape(auto, PARSERS["hermes"], REASONING["qwen3"]),
        "named": ChatShape(parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)),
        "required": ChatShape(parse_tools([WEATHER], "required", None)),
        "plain": ChatShape(parse_tools(None, None, None), None, REASONING["deepseek-r1"]),
    }


TEXTS = {
    "reasoning+hermes": "<think>hmm</think>Sure. " + FORMATS["hermes"].split(".", 1)[1],
    "named": ARGS,
    "required": f'[{{"name": "get_weather", "parameters": {ARGS}}}]',
    "plain": "<think>x < y</think>The answer: <b>",
}


@pytest.mark.parametrize("kind", list(TEXTS))
def test_streamed_deltas_put_back_together_equal_the_whole_message(kind):
    shape, text = shapes()[kind], TEXTS[kind]
    whole, finish = shape.message(text, "stop")
    for step in (1, 3, 7):  # pieces of every size: markers split anywhere
        stream = ChoiceStream(shape)
        deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i : i + step])]
        more, streamed_finish = stream.end("stop")
        deltas += more
        content = "".join(d.get("content", "") for d in deltas)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        calls: dict[int, list[str]] = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                slot = calls.setdefault(c["index"], ["", ""])
                slot[0] += c.get("function", {}).get("name", "")
                slot[1] += c.get("function", {}).get("arguments", "")
        assert content == (whole["content"] or "") and streamed_finish == finish
        assert reasoning == (whole.get("reasoning_content") or "")
        assert [tuple(v) for v in calls.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])
        ]
    assert (finish == "tool_calls") == (kind in ("reasoning+hermes", "named", "required"))


def test_required_schema_is_an_array_of_the_tools_and_one_without_parallel_calls():
    spec = parse_tools([WEATHER], "required", False).constraint()
    schema = json.loads(spec.value)
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    assert parse_tools([WEATHER], "auto", None).constraint() is None


@pytest.mark.parametrize(
    "body,param",
    [
        ({"guided_json": 3}, "guided_json"),
        ({"guided_choice": []}, None),  # an empty list is "not set"
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, "response_format.json_schema.strict"),
    ],
)  # fmt: skip
def test_constraint_fields_check_their_shape(body, param):
    if param is None:
        assert from_body(body) is None
        return
    with pytest.raises(InvalidRequest) as e:
        from_body(body)
    assert e.value.param == param


class Address(BaseModel):
    street: str
    kind: Literal["home", "work"]


class Person(BaseModel):
    name: str
    address: Address
    backup: Address | None = None
    friends: list[Person] = []


PERSON = {"type": "function", "function": {"name": "add_person", "parameters": Person.model_json_schema()}}
NAMED = {"type": "function", "function": {"name": "add_person"}}
ALICE = {"name": "A", "address": {"street": "s", "kind": "home"}, "backup": None, "friends": [
    {"name": "B", "address": {"street": "t", "kind": "work"}, "backup": {"street": "u", "kind": "home"}, "friends": []}
]}  # fmt: skip


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_tool_schemas_with_defs_refs_anyof_enums_and_recursion_compile_and_match(choice):
    """A pydantic model's parameters ($defs, $ref, anyOf for Optional, an enum, a recursive list) keep their
    references resolvable inside required's array schema (and named's), and the grammar takes exactly them."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    spec = parse_tools([WEATHER, PERSON], choice, None).constraint()
    grammar = xgr.Grammar.from_json_schema(spec.value, strict_mode=True)
    call = ALICE if choice == NAMED else [{"name": "add_person", "parameters": ALICE}]
    assert _is_grammar_accept_string(grammar, json.dumps(call))
    bad = json.loads(json.dumps(call).replace('"work"', '"school"'))
    assert not _is_grammar_accept_string(grammar, json.dumps(bad))
    extra = json.dumps(call).replace('"street": "t"', '"street": "t", "zip": "1"')
    assert not _is_grammar_accept_string(grammar, extra)  # strict: no invented keys
