"""The Responses API's translation, without a server: requests as the chat bodies that serve them (and the 400s
naming the Responses field), chat answers and streams as the Response object and the typed events the OpenAI
SDK's own types accept (in OpenAI's order, sequence numbers counting up), and the bounded store shared by a
router group's processes."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from common.wire.errors import InvalidRequest, NotFound, TandemError
from common.wire.responses import ResponsesRequest, to_chat
from common.wire.responses_call import ResponseCall, Responses, responses_error
from common.wire.responses_output import Shell
from common.wire.responses_store import ResponsesStore
from common.wire.responses_stream import ResponsesStream, SSETranslator
from common.wire.sse import DONE, sse_event

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
EVENTS = TypeAdapter(ResponseStreamEvent)


def chat_of(body: dict, history: list | None = None) -> dict:
    return to_chat(ResponsesRequest.parse(body), history or [])


def test_items_become_messages_with_tool_calls_and_outputs():
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        "max_output_tokens": 7,
        "stream": True,
    }  # fmt: skip
    chat = chat_of(body)
    calls = [
        {"id": c, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}} for c in ("c1", "c2")
    ]
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather ?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True}}  # fmt: skip
    assert chat["max_completion_tokens"] == 7 and chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"input": [{"type": "foo"}]}, "input[0].type", "'foo' is not one of"),
        ({"input": [{"type": "function_call_output", "call_id": "x", "output": "1"}]}, "input[0].call_id", "no function_call"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "hosted tool 'web_search'"),
        ({"input": "hi", "background": True}, "background", "not supported"),
        ({"input": "hi", "temperature": "1"}, "temperature", ""),
        ({"input": ""}, "input", ""),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type", "only text"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type", "json_schema"),
        ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity", "not supported"),
        ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice", "give"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(body, param, words):
    with pytest.raises(InvalidRequest) as e:
        chat_of(body)
    assert e.value.param == param and words in e.value.message


def test_chat_errors_name_the_responses_field():
    err = {"error": {"message": "max_completion_tokens: too many", "type": "x", "code": 400, "param": "max_completion_tokens"}}  # fmt: skip
    assert responses_error(err)["error"] | {"type": "x"} == err["error"] | {
        "param": "max_output_tokens",
        "message": "max_output_tokens: too many",
    }
    assert (
        responses_error({"error": {"message": "m", "param": "tools[0].function.name"}})["error"]["param"]
        == "tools[0].name"
    )


ANSWER = {
    "model": "m",
    "choices": [
        {
            "message": {
                "role": "assistant",
                "content": "hi",
                "reasoning_content": "think",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            "finish_reason": "length",
        }
    ],
    "usage": {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 4},
    },
}


def test_a_chat_answer_is_a_response_the_sdk_reads():
    shell = Shell(ResponsesRequest.parse({"input": "hi", "metadata": {"k": "v"}, "max_output_tokens": 3}))
    r = Response.model_validate(shell.from_chat(ANSWER))
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]
    assert r.output_text == "hi" and r.output[2].call_id == "call_1" and r.metadata == {"k": "v"}
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens) == (5, 4, 3)


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_a_chat_stream_becomes_openais_events_in_order():
    done = []
    translator = SSETranslator(ResponsesStream(Shell(ResponsesRequest.parse({"input": "hi"}))), done.append)
    pieces = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "th"}),
        chunk({"reasoning_content": "ink"}),
        chunk({"content": "h"}),
        chunk({"content": "i"}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
        chunk({}, "tool_calls"),
        {"choices": [], "usage": ANSWER["usage"]},
    ]  # fmt: skip
    data = b"".join(translator.feed(sse_event(p)) for p in pieces) + translator.feed(DONE)
    events = [EVENTS.validate_python(json.loads(line[6:])) for line in data.split(b"\n") if line.startswith(b"data: ")]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "hi" and final.output[0].content[0].text == "think"
    assert final.output[2].arguments == "{}" and final.usage.total_tokens == 8 and final.model == "m"
    assert len(done) == 1 and done[0]["id"] == final.id and done[0]["status"] == "completed"
    assert translator.feed(DONE) == b""  # nothing after the end


def test_a_cancelled_stream_ends_at_its_next_event():
    responses = Responses(ResponsesStore(4))
    call = ResponseCall({"input": "hi", "stream": True}, responses)
    translator = call.translator()
    translator.feed(sse_event(chunk({"content": "a"})))
    assert responses.store.get(call.shell.id)["status"] == "in_progress"
    assert responses.cancel(call.shell.id)["status"] == "cancelled"
    out = translator.feed(sse_event(chunk({"content": "b"})))
    assert translator.ended and b'"response.failed"' in out and b'"delta": "b"' not in out
    assert responses.store.get(call.shell.id)["status"] == "cancelled"
    with pytest.raises(InvalidRequest):  # no longer running
        responses.cancel(call.shell.id)


def test_the_store_is_bounded_and_shared_by_processes(tmp_path):
    path = str(tmp_path / "responses.sqlite")
    one, two = ResponsesStore(2, path), ResponsesStore(2, path)  # two router processes of a group
    for i in range(3):
        one.put({"id": f"r{i}", "output": [{"type": "message", "n": i}]}, [{"type": "message", "i": i}])
    assert two.get("r2")["id"] == "r2" and len(two) == 2
    assert two.history("r1") == [{"type": "message", "i": 1}, {"type": "message", "n": 1}]
    with pytest.raises(NotFound) as e:
        two.history("r0")  # evicted: the oldest
    assert e.value.param == "previous_response_id" and "'r0'" in e.value.message and "evicted" in e.value.message
    two.delete("r2")
    with pytest.raises(TandemError):
        one.get("r2")


def test_a_cancel_asked_of_another_process_of_the_group_reaches_the_stream(tmp_path, monkeypatch):
    monkeypatch.setattr("common.wire.responses_stream.CANCEL_POLL_S", 0.0)
    path = str(tmp_path / "responses.sqlite")
    streaming, other = Responses(ResponsesStore(4, path)), Responses(ResponsesStore(4, path))
    call = ResponseCall({"input": "hi", "stream": True}, streaming)
    translator = call.translator()
    translator.feed(sse_event(chunk({"content": "a"})))
    assert other.cancel(call.shell.id)["status"] == "cancelled"
    assert b'"status": "cancelled"' in translator.feed(sse_event(chunk({"content": "b"})))
    assert other.store.get(call.shell.id)["status"] == "cancelled" and translator.ended
