"""OpenAI's Responses API through the PD router and on a monolithic server, driven by the OpenAI SDK unchanged
(`responses.create`, `.stream`, `.parse`, a function-call loop with previous_response_id): greedy answers equal
the monolithic server's, streams carry OpenAI's typed events in order and end in the answer the plain call
gives, the store keeps and forgets responses (a --processes 2 router group shares it, bounded), a running
stream is cancelled, and bad input is a 400/404 naming the field. The built-in model is tiny: tools are
forced where the client allows; the protocol is what is judged."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.cluster import start_router
from tests.integration.scripted_model import THINKING, save_scripted_model
from tests.integration.test_structured_output import BUILTIN, SCHEMA

# the modules sharing the built-in model's cluster: this one, test_client_frameworks, test_pd_structured, test_batched_api
CLUSTER_USERS = 4
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
ASK = "What is the capital of France?"


class City(BaseModel):
    city: str = Field(max_length=20)
    population: int = Field(ge=0, le=99999999)
    capital: bool


@pytest.fixture(scope="module")
def mono(reference_servers):
    return reference_servers.get(*BUILTIN)


@pytest.fixture(scope="module")
def cluster(shared_clusters):
    c = shared_clusters.get("mooncake", BUILTIN)
    yield c
    shared_clusters.done("mooncake", BUILTIN, CLUSTER_USERS)


@pytest.fixture(scope="module")
def model(mono) -> str:
    return httpx.get(mono.url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    for name in ("mono", "cluster"):
        if name in request.fixturenames:
            request.getfixturevalue(name).wait_idle()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def both(mono, cluster, ask):
    """`ask(client)` of the monolithic server and of the router at once: (mono's, the router's)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return tuple(pool.map(ask, (client(mono), client(cluster))))


STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def test_create_stream_retrieve_delete_equal_monolithic(mono, cluster, model):
    """Greedy text answers of the router equal the monolithic server's; each stream's events come in OpenAI's
    order and end in the plain answer; the stored response reads back, and is gone once deleted."""
    asks = [
        {"input": ASK},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]}],
         "instructions": "Answer in one line.", "metadata": {"run": "1"}, "user": "u1"},
        {"input": "Count: 1, 2, 3,", "max_output_tokens": 5},
    ]  # fmt: skip
    for ask in asks:
        fields = {"model": model, "temperature": 0, "max_output_tokens": 40} | ask
        want, got = both(mono, cluster, lambda c: c.responses.create(**fields))
        assert got.output_text == want.output_text and got.output_text
        assert got.usage.input_tokens == want.usage.input_tokens and got.usage.output_tokens == want.usage.output_tokens
        assert got.status == ("incomplete" if ask.get("max_output_tokens") == 5 else "completed")
        assert got.metadata == ask.get("metadata", {}) and got.instructions == ask.get("instructions")
        for server, r in ((mono, want), (cluster.router, got)):  # one log line per response
            assert server.log_path.read_text(errors="replace").count(f"response {r.id}: {r.status}") == 1
        for c in (client(mono), client(cluster)):
            with c.responses.stream(**fields) as stream:
                events = list(stream)
            types, final = [e.type for e in events], events[-1].response  # the SDK's final: completed ones
            assert final.output_text == want.output_text and final.status == got.status
            deltas = types.count("response.output_text.delta")
            assert deltas >= 1 and types == STREAM_ORDER[:4] + ["response.output_text.delta"] * deltas + STREAM_ORDER[
                5:
            ] + ["response." + final.status]
            assert c.responses.retrieve(final.id).output_text == final.output_text
            c.responses.delete(final.id)
            with pytest.raises(openai.NotFoundError) as e:
                c.responses.retrieve(final.id)
            assert e.value.body["param"] == "response_id" and final.id in e.value.body["message"]
    assert client(cluster).models.retrieve(model).id == model == got.model


def test_parse_and_a_function_call_loop_with_previous_response_id(mono, cluster, model):
    """parse() with a pydantic output type, then a forced function call answered by its output in a
    continuation (previous_response_id): the router's answers equal the monolithic server's at each step, and
    the continuation's prompt starts with the first one's (its cached tokens)."""
    ask = "Give the city, population and whether it is a capital for Paris as JSON."

    def parse(c: openai.OpenAI):
        return c.responses.parse(model=model, input=ask, text_format=City, temperature=0, max_output_tokens=80)

    want, got = both(mono, cluster, parse)
    assert isinstance(got.output_parsed, City) and got.output_parsed == want.output_parsed
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}
    plain = client(cluster).responses.create(model=model, input=ask, text=fmt, temperature=0, max_output_tokens=80)
    jsonschema.validate(json.loads(plain.output_text), SCHEMA)

    def loop(c: openai.OpenAI):
        first = c.responses.create(
            model=model, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required", temperature=0,
            max_output_tokens=60,
        )  # fmt: skip
        calls = [item for item in first.output if item.type == "function_call"]
        assert calls and all(call.name == "get_weather" for call in calls)
        outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"} for call in calls]
        second = c.responses.create(
            model=model,
            previous_response_id=first.id,
            input=outputs,
            tools=[WEATHER],
            temperature=0,
            max_output_tokens=30,
        )
        return first, second

    (want1, want2), (got1, got2) = both(mono, cluster, loop)
    strip = lambda r: [(i.name, i.arguments) for i in r.output if i.type == "function_call"]  # noqa: E731
    assert strip(got1) == strip(want1) and got2.output_text == want2.output_text
    assert got2.previous_response_id == got1.id and got2.usage.input_tokens > got1.usage.input_tokens
    assert got2.usage.input_tokens_details.cached_tokens > 0 and want2.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"input": [{"type": "foo"}]}, 400, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, 400, "input[0].call_id"),
        ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, 400, "tools[0].type"),
        ({"input": "hi", "max_output_tokens": 100000}, 400, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, 400, "text.format.schema"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_input_is_a_4xx_naming_the_field(mono, cluster, body, status, param):
    for server in (mono, cluster):
        r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param, r.text


def cancelled_stream(url: str) -> list[dict]:
    """The events of a long stream cancelled at its fourth delta (a new connection asks)."""
    body = {"input": "Write a long story about a cat.", "max_output_tokens": 2000, "stream": True, "temperature": 1}
    events = []
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]))
            if events[-1]["type"] == "response.output_text.delta" and len(events) == 8:
                rid = events[0]["response"]["id"]
                assert httpx.get(f"{url}/v1/responses/{rid}").json()["status"] == "in_progress"
                cancel = httpx.post(f"{url}/v1/responses/{rid}/cancel", timeout=10)
                assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled", cancel.text
    return events


def test_cancel_ends_a_running_stream_and_frees_its_pages(cluster):
    events = cancelled_stream(cluster.url)
    rid = events[0]["response"]["id"]
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "cancelled"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    stored = httpx.get(f"{cluster.url}/v1/responses/{rid}").json()
    assert stored["status"] == "cancelled" and len(stored["output"][0]["content"][0]["text"]) > 0
    again = httpx.post(f"{cluster.url}/v1/responses/{rid}/cancel", timeout=10)
    assert again.status_code == 400 and again.json()["error"]["param"] == "response_id"
    cluster.wait_idle()  # the decode and the prefill freed every page of the cancelled request


def test_a_router_group_shares_one_bounded_store(cluster):
    """Two router processes (--processes 2) on one port: a response stored by either reads back from both (many
    connections, spread by the kernel); past --responses-store-size the oldest are a 404 naming them."""
    prefills = list(zip(cluster.prefills, cluster.prefill_bootstrap_ports))
    group = start_router(prefills, cluster.decodes, "--processes", "2", "--responses-store-size", "3", name="group")
    try:
        ids = []
        for i in range(5):
            r = httpx.post(group.url + "/v1/responses", json={"input": f"Say {i}.", "max_output_tokens": 3}, timeout=60)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        for _ in range(4):  # new connections each: both processes answer
            for rid in ids[2:]:
                assert httpx.get(f"{group.url}/v1/responses/{rid}", timeout=10).json()["id"] == rid
            for rid in ids[:2]:
                r = httpx.get(f"{group.url}/v1/responses/{rid}", timeout=10)
                assert r.status_code == 404 and rid in r.json()["error"]["message"]
        cont = {"input": "Again.", "previous_response_id": ids[0], "max_output_tokens": 3}
        r = httpx.post(group.url + "/v1/responses", json=cont, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
        events = cancelled_stream(group.url)  # the cancel may reach the other process: the store carries it
        assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "cancelled"
    finally:
        group.stop()


def test_reasoning_and_an_auto_call_are_items_streamed_and_not(tmp_path_factory, builtin_model_dir, reference_servers):
    """The reasoning parser's thinking is a reasoning item and the tool parser's call a function_call item (the
    scripted model writes both), whole and streamed."""
    path = save_scripted_model(tmp_path_factory.mktemp("scripted"), builtin_model_dir)
    scripted = reference_servers.get(
        "--model", str(path), "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--page-size", "4"
    )
    tool = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    fields = {"model": "scripted", "input": "What time is it?", "tools": [tool], "max_output_tokens": 60}
    c = client(scripted)
    fields["model"] = c.models.list().data[0].id
    whole = c.responses.create(**fields)
    with c.responses.stream(**fields) as stream:
        events = list(stream)
    for r in (whole, stream.get_final_response()):
        assert [i.type for i in r.output] == ["reasoning", "function_call"] and r.status == "completed"
        assert r.output[0].content[0].text == THINKING and (r.output[1].name, r.output[1].arguments) == (
            "get_time",
            "{}",
        )
    types = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THINKING
    assert types.index("response.function_call_arguments.done") > types.index("response.reasoning_text.done")
    scripted.wait_idle()
