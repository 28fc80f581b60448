"""Structured outputs and tool calls through the PD router (built-in model, Mooncake TCP): the prefill
samples the first token under the grammar and the decode continues it, so greedy constrained output
equals a monolithic server's token for token; the OpenAI SDK's parse() and tool-call loop run against the
router unchanged; a prefill that samples a first token the decode's grammar forbids (a pair configured
apart) fails that request with an error naming the grammar, and no page stays held on either side."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import start_server
from tests.integration.cluster import start_router
from tests.integration.test_responses_api import cluster, mono  # noqa: F401 (fixtures: one cluster for CLUSTER_USERS modules)
from tests.integration.test_structured_output import ASK, BUILTIN, SCHEMA, TIME, WEATHER
from tests.ports import free_port

CONSTRAINED = [
    {"sampling_params": {"regex": r"(yes|no), [a-z]{2,8}\."}},
    {"sampling_params": {"ebnf": 'root ::= "The answer is " ("yes" | "no") "."'}},
    {"sampling_params": {"json_schema": json.dumps(SCHEMA)}},
]


def chat(url: str, content: str = ASK, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 60, "temperature": 0} | fields
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def on_both(mono, cluster, ask):
    """`ask(url)` of the monolithic server and of the cluster at once (two processes): (mono's, the cluster's)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        want, got = pool.map(ask, (mono.url, cluster.url))
    return want, got


def test_greedy_constrained_tokens_equal_monolithic(mono, cluster, builtin_model_dir):
    for fields in CONSTRAINED:
        body = {"text": "Is Paris the capital of France? Answer:", **fields}
        body["sampling_params"] |= {"max_new_tokens": 40, "temperature": 0}
        want, got = on_both(mono, cluster, lambda u: httpx.post(u + "/generate", json=body, timeout=300).json())
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"], fields
        assert got["meta_info"]["finish_reason"]["type"] == "stop"
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for fields in [{"response_format": fmt}, {"response_format": {"type": "json_object"}, "max_tokens": 30}]:
        want, got = on_both(mono, cluster, lambda u: chat(u, **fields))
        assert got["message"] == want["message"]
    cluster.wait_idle()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_equal_monolithic(mono, cluster, choice):
    fields = {"tools": [WEATHER, TIME], "tool_choice": choice}
    want, got = on_both(mono, cluster, lambda u: chat(u, "What is the weather in Paris?", **fields))
    strip = lambda calls: [c["function"] for c in calls]  # noqa: E731 (ids are fresh per answer)
    assert strip(got["message"]["tool_calls"]) == strip(want["message"]["tool_calls"])
    assert got["finish_reason"] == want["finish_reason"] == "tool_calls"
    cluster.wait_idle()


class City(BaseModel):
    city: str = Field(max_length=20)
    population: int = Field(ge=0, le=99999999)
    capital: bool


def test_openai_sdk_parse_and_tool_loop_against_the_router(cluster):
    client = openai.OpenAI(api_key="unused", base_url=cluster.url + "/v1", max_retries=0)
    parsed = client.chat.completions.parse(
        model="default", messages=[{"role": "user", "content": ASK}], response_format=City, temperature=0, max_tokens=60
    )
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.city
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60
    )
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], temperature=0, max_tokens=16
    )
    assert second.choices[0].message.content and second.choices[0].finish_reason in ("stop", "length")
    cluster.wait_idle()


def test_a_first_token_the_grammar_forbids_fails_the_request_and_frees_everything(cluster):
    """A prefill with --reasoning-parser samples the first token unconstrained (thinking), while the decode
    without one expects it constrained: the decode refuses the token, naming the grammar."""
    boot = str(free_port())
    odd = start_server(
        *("--disaggregation-mode", "prefill", "--transfer-backend", "mooncake", "--bootstrap-port", boot),
        *BUILTIN,
        *("--reasoning-parser", "deepseek-r1"),
        name="prefill-odd",
    ).wait_ready()
    router = start_router([(odd, int(odd.arg("--bootstrap-port")))], cluster.decodes, name="router-odd")
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "guided_regex": "(yes|no)"}
        r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 502, r.text
        message = r.json()["error"]["message"]
        assert "the prefill's first token" in message and "the regex grammar of guided_regex" in message
        odd.wait_idle()
        cluster.decodes[0].wait_idle()
    finally:
        router.stop()
        odd.stop()
