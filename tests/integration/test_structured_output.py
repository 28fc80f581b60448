"""Structured outputs, tool calls and reasoning on monolithic servers: every constraint field gives output
that matches it (the built-in model, greedy and sampled, n > 1, streamed), bad grammars and tool fields
are 400s naming the field before anything is scheduled, a grammar that admits no token ends that request
alone, and the scripted model's text (thinking, then a Hermes tool call) comes back split into
reasoning_content and tool_calls, streamed and not. The PD path: test_pd_structured.py."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import pytest

from tests.integration.scripted_model import THINKING, save_scripted_model

# the full model (tests/served_model.py): its answers end; test_api_fields.py's flags
BUILTIN = ("--model", "builtin", "--page-size", "4", "--chunked-prefill-size", "32", "--max-total-tokens", "4096")
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server(reference_servers):
    return reference_servers.get(*BUILTIN)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, builtin_model_dir, reference_servers):
    path = save_scripted_model(tmp_path_factory.mktemp("scripted"), builtin_model_dir)
    return reference_servers.get(
        "--model", str(path), "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--page-size", "4"
    )


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300)


ASK = "Give the city, population and whether it is a capital for Paris as JSON."


def chat(server, content: str = ASK, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 60, "temperature": 0} | fields
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(server, content: str = ASK, **fields) -> list[dict]:
    """The choices' deltas of a streamed chat completion, with their finish reasons."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 60, "temperature": 0, "stream": True}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body | fields, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                assert "error" not in data, data
                chunks += data["choices"]
    return chunks


def assembled(chunks: list[dict]) -> dict:
    """A streamed choice put together as the OpenAI SDK does: content, reasoning and tool calls by index."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for c in chunks:
        d = c["delta"]
        msg["content"] += d.get("content") or ""
        msg["reasoning_content"] += d.get("reasoning_content") or ""
        for call in d.get("tool_calls", []):
            slot = msg["tool_calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = call.get("id", slot["id"])
            slot["name"] += call.get("function", {}).get("name", "")
            slot["arguments"] += call.get("function", {}).get("arguments", "")
        if c["finish_reason"]:
            msg["finish_reason"] = c["finish_reason"]
    return msg


@pytest.fixture(autouse=True)
def pools_idle_after(request):
    yield
    for name in ("server", "scripted"):
        if name in request.fixturenames:
            request.getfixturevalue(name).wait_idle()


# -- every constraint field -----------------------------------------------------------------------


def test_response_format_json_schema_strict_validates(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    choice = chat(server, response_format=fmt)["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_json_object_streamed_equals_whole(server):
    whole = chat(server, response_format={"type": "json_object"}, max_tokens=40)["choices"][0]
    streamed = assembled(stream_chat(server, response_format={"type": "json_object"}, max_tokens=40))
    assert streamed["content"] == whole["message"]["content"] and whole["message"]["content"].startswith("{")
    if whole["finish_reason"] == "stop":
        assert isinstance(json.loads(whole["message"]["content"]), dict)


@pytest.mark.parametrize(
    "path,fields,check",
    [
        ("/generate", {"sampling_params": {"regex": r"(yes|no), [a-z]{2,8}\."}}, r"(yes|no), [a-z]{2,8}\."),
        ("/v1/completions", {"guided_regex": r"[0-9]{3}-[0-9]{4}"}, r"[0-9]{3}-[0-9]{4}"),
        ("/v1/completions", {"guided_choice": ["Paris", "London", "Rome"]}, "Paris|London|Rome"),
        (
            "/v1/completions",
            {"guided_grammar": 'root ::= "The answer is " ("yes" | "no") "."'},
            "The answer is (yes|no)\\.",
        ),
        ("/v1/completions", {"structured_outputs": {"regex": "[A-Z][a-z]{1,8}"}}, "[A-Z][a-z]{1,8}"),
        ("/generate", {"sampling_params": {"ebnf": 'root ::= [a-c] [a-c]? "!"'}}, "[a-c]{1,2}!"),
    ],
)
def test_regex_ebnf_and_choice_fields_are_matched(server, path, fields, check):
    if path == "/generate":
        body = {"text": "The capital of France is", **fields}
        body["sampling_params"] |= {"max_new_tokens": 24, "temperature": 0}
        text = post(server, path, body).json()["text"]
    else:
        body = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0, **fields}
        r = post(server, path, body)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert re.fullmatch(check, text), text


def test_n_choices_sampled_with_logprobs_each_validate(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    out = chat(server, response_format=fmt, n=3, temperature=1.0, seed=7, logprobs=True, max_tokens=80)
    assert len(out["choices"]) == 3
    for choice in out["choices"]:
        assert choice["logprobs"]["content"] and all(e["logprob"] <= 0 for e in choice["logprobs"]["content"])
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert sum(c["finish_reason"] == "stop" for c in out["choices"]) >= 2


def test_max_tokens_inside_a_value_ends_with_length(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    choice = chat(server, response_format=fmt, max_tokens=3)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")


def test_stop_string_ends_constrained_output(server):
    body = {"text": "Count:", "sampling_params": {"regex": "(1, 2, 3, 4, 5)", "max_new_tokens": 20, "temperature": 0}}
    body["sampling_params"]["stop"] = [", 3"]
    out = post(server, "/generate", body).json()
    assert out["text"] == "1, 2" and out["meta_info"]["finish_reason"]["matched"] == ", 3"


# -- tool calls on the built-in model (constrained) ----------------------------------------------


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_calls_streamed_and_not(server, choice):
    fields = {"tools": [WEATHER, TIME], "tool_choice": choice}
    whole = chat(server, "What is the weather in Paris?", **fields)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    calls = whole["message"]["tool_calls"]
    assert calls and all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    named = [c for c in calls if c["function"]["name"] == "get_weather"]
    for c in named:
        jsonschema.validate(json.loads(c["function"]["arguments"]), WEATHER["function"]["parameters"])
    if isinstance(choice, dict):
        assert len(calls) == len(named) == 1
    streamed = assembled(stream_chat(server, "What is the weather in Paris?", **fields))
    got = [(c["name"], json.loads(c["arguments"])) for c in streamed["tool_calls"].values()]
    assert got == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == ""


PERSON_SCHEMA = {  # what pydantic writes for a nested, optional, enumerated and recursive model
    "$defs": {
        "Address": {
            "properties": {"street": {"type": "string", "maxLength": 12}, "kind": {"enum": ["home", "work"], "type": "string"}},
            "required": ["street", "kind"], "type": "object",
        },
        "Person": {"$ref": "#"},
    },
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"$ref": "#/$defs/Address"},
        "backup": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]},
        "friends": {"type": "array", "items": {"$ref": "#/$defs/Person"}, "maxItems": 0},  # the ref compiles; no depth
    },
    "required": ["name", "address", "backup", "friends"], "type": "object",
}  # fmt: skip
PERSON = {"type": "function", "function": {"name": "add_person", "parameters": PERSON_SCHEMA}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add_person"}}])
def test_tools_with_defs_refs_and_recursion_are_called_with_their_schema(server, choice):
    """pydantic models as parameters ($defs, $ref, anyOf, an enum, recursion) compile and constrain the call,
    also with a response_format beside the forced tool_choice (OpenAI takes both: the call follows the tool)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    for extra in ({}, {"response_format": fmt}):
        out = chat(server, "Add Alice.", tools=[WEATHER, PERSON], tool_choice=choice, max_tokens=300, **extra)
        choice0 = out["choices"][0]
        assert choice0["finish_reason"] == "tool_calls", choice0
        for call in choice0["message"]["tool_calls"]:
            tool = {"get_weather": WEATHER, "add_person": PERSON}[call["function"]["name"]]
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])


def test_json_schema_without_strict_has_only_its_properties(server):
    """No `strict` (instructor's JSON_SCHEMA mode), no additionalProperties: the object closes after the
    schema's keys (xgrammar's strict mode, as vLLM and SGLang compile every JSON schema)."""
    loose = {k: v for k, v in SCHEMA.items() if k != "additionalProperties"}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": loose}}
    choice = chat(server, response_format=fmt, max_tokens=100)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert set(json.loads(choice["message"]["content"])) == {"city", "population", "capital"}


def test_n_choices_with_tools_and_top_logprobs_each_call_the_tool(server):
    out = chat(
        server, "What is the weather in Paris?", tools=[WEATHER], tool_choice="required", n=2, temperature=0.8,
        seed=1, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice in out["choices"]:
        assert choice["finish_reason"] == "tool_calls" and all(
            len(t["top_logprobs"]) == 2 for t in choice["logprobs"]["content"]
        )
        for call in choice["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def test_parallel_tool_calls_false_allows_one_call(server):
    out = chat(server, "Weather in Paris and Rome?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert len(out["choices"][0]["message"]["tool_calls"]) == 1


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,fields,param,words",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
         "response_format.json_schema.schema", "does not compile"),
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type", "not one of"),
        ("/v1/chat/completions", {"guided_regex": "(abc"}, "guided_regex", "parenthesis"),
        ("/v1/completions", {"guided_grammar": "root ::= foo"}, "guided_grammar", "not defined"),
        ("/v1/completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ("/generate", {"sampling_params": {"json_schema": '{"type": "object"}', "regex": "a"}}, "sampling_params.regex", "only one"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
        ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "no tool named 'nope'"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "give tools"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "letters"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field_before_scheduling(server, path, fields, param, words):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    if path == "/generate":
        base = {"text": "hi"}
    before = server.log_path.read_text(errors="replace").count("request ")
    r = post(server, path, base | fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert server.log_path.read_text(errors="replace").count("request ") == before  # nothing reached the engine


def test_a_grammar_that_admits_no_token_ends_that_request_alone(server):
    bad = {"text": "hi", "sampling_params": {"regex": "a", "min_new_tokens": 3, "max_new_tokens": 8, "temperature": 0}}
    good = {"text": "hi", "sampling_params": {"regex": "(b|c)+", "max_new_tokens": 8, "temperature": 0}}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, server, "/generate", b) for b in (bad, good, good)]
        results = [f.result() for f in futures]
    assert results[0].status_code == 400
    assert "the regex grammar of sampling_params.regex admits no token" in results[0].json()["error"]["message"]
    assert all(r.status_code == 200 and re.fullmatch("(b|c)+", r.json()["text"]) for r in results[1:])


# -- tool_choice auto and reasoning (the scripted model) -----------------------------------------


def test_auto_tool_call_and_reasoning_are_split_out(scripted):
    out = chat(scripted, "What time is it?", tools=[TIME])["choices"][0]
    msg = out["message"]
    assert out["finish_reason"] == "tool_calls"
    assert (msg["content"], msg["reasoning_content"]) == (None, THINKING)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("get_time", "{}")]
    streamed = assembled(stream_chat(scripted, "What time is it?", tools=[TIME]))
    assert streamed["reasoning_content"] == THINKING and streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == [("get_time", "{}")]
    assert streamed["finish_reason"] == "tool_calls"


def test_without_tools_the_call_text_is_content(scripted):
    msg = chat(scripted, "What time is it?")["choices"][0]["message"]
    assert msg["reasoning_content"] == THINKING
    assert msg["content"] == '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'


def test_a_grammar_applies_after_the_thinking(scripted):
    """The thinking is the script's; after </think> the regex decides (the script's next token is not allowed)."""
    whole = chat(scripted, "Yes or no?", guided_regex="(yes|no)")["choices"][0]
    assert whole["message"]["reasoning_content"] == THINKING
    assert whole["message"]["content"] in ("yes", "no") and whole["finish_reason"] == "stop"
    streamed = assembled(stream_chat(scripted, "Yes or no?", guided_regex="(yes|no)"))
    assert (streamed["reasoning_content"], streamed["content"]) == (THINKING, whole["message"]["content"])
