"""Agent frameworks against the PD router, unchanged but for base_url (the packages pinned in the test extra):
the OpenAI Agents SDK with its Responses model and its Chat Completions model (a forced function tool, a
typed output), LangChain's ChatOpenAI (invoke, stream, with_structured_output by json_schema and by
function_calling, bind_tools, the Responses API), pydantic-ai with a typed output on both APIs, instructor in
its TOOLS and JSON_SCHEMA modes; and aiperf's `profile` on the chat endpoint, from its own venv
(tests/tool_venv.py). The model is tiny: tools are forced where the client allows; what is judged is the
protocol (every call answered, every typed output validated by the client's own parser)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.test_responses_api import City, cluster, model, mono  # noqa: F401 (fixtures)
from tests.tool_venv import INSTALL_TIMEOUT_S, tool

ASK = "What is the weather in Paris?"


class Trip(BaseModel):
    """A nested model: its schema has $defs and a $ref, as the frameworks send them."""

    city: City
    days: int = Field(ge=1, le=30)


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    cluster.wait_idle()


def test_openai_agents_sdk_on_both_of_its_models(cluster, model):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
    for llm in (OpenAIResponsesModel(model, client), OpenAIChatCompletionsModel(model, client)):
        settings = ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60)
        agent = Agent(
            name="weather", instructions="Use the tool.", model=llm, tools=[get_weather], model_settings=settings,
            tool_use_behavior="stop_on_first_tool",
        )  # fmt: skip
        result = Runner.run_sync(agent, ASK)
        assert cities and result.final_output == f"Sunny in {cities[-1]}", type(llm)
        typed = Agent(
            name="trip", model=llm, output_type=Trip, model_settings=ModelSettings(temperature=0, max_tokens=120)
        )
        assert isinstance(Runner.run_sync(typed, "Plan a trip to Paris.").final_output, Trip), type(llm)


def test_langchain_chat_openai(cluster, model):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}"

    llm = ChatOpenAI(
        model=model, base_url=cluster.url + "/v1", api_key="none", temperature=0, max_tokens=40, max_retries=0
    )
    whole = llm.invoke("What is the capital of France?")
    assert whole.content and whole.usage_metadata["input_tokens"] > 0
    assert "".join(chunk.content for chunk in llm.stream("What is the capital of France?")) == whole.content
    for method in ("json_schema", "function_calling"):
        structured = llm.with_structured_output(Trip, method=method).bind(max_tokens=120)
        assert isinstance(structured.invoke("Plan a trip to Paris."), Trip), method
    call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(ASK).tool_calls
    assert [c["name"] for c in call] == ["get_weather"] and isinstance(call[0]["args"]["city"], str)
    responses = ChatOpenAI(
        model=model, base_url=cluster.url + "/v1", api_key="none", temperature=0, max_tokens=40, max_retries=0,
        use_responses_api=True,
    )  # fmt: skip
    assert responses.invoke("What is the capital of France?").text == whole.content


def test_pydantic_ai_typed_output_on_both_apis(cluster, model):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=cluster.url + "/v1", api_key="none")
    for llm in (OpenAIChatModel(model, provider=provider), OpenAIResponsesModel(model, provider=provider)):
        agent = Agent(llm, output_type=Trip, model_settings={"temperature": 0, "max_tokens": 120})
        assert isinstance(agent.run_sync("Plan a trip to Paris.").output, Trip), type(llm)


def test_instructor_tools_and_json_schema_modes(cluster, model):
    import instructor

    statuses: list[int] = []
    http = httpx.Client(event_hooks={"response": [lambda r: statuses.append(r.status_code)]})
    raw = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, http_client=http)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        llm = instructor.from_openai(raw, mode=mode)
        trip = llm.chat.completions.create(
            model=model, response_model=Trip, messages=[{"role": "user", "content": "Plan a trip to Paris."}],
            temperature=0, max_tokens=120, max_retries=1,
        )  # fmt: skip
        assert isinstance(trip, Trip), mode
    assert statuses == [200, 200]  # each mode's one request accepted and its answer valid at the first try


@pytest.fixture(scope="module")
def aiperf() -> Path:
    return tool("aiperf")


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 300)  # a cold venv is made first (started at collection)
def test_aiperf_profile_on_the_chat_endpoint(cluster, model, aiperf, builtin_model_dir, tmp_path):
    """NVIDIA's benchmark tool, installed on its own: 20 streamed synthetic requests, 4 at a time, none failed."""
    out = subprocess.run(
        [
            str(aiperf), "profile", "--model", model, "--url", cluster.url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(builtin_model_dir), "--request-count", "20", "--concurrency", "4",
            "--prompt-input-tokens-mean", "24", "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", "12", "--prompt-output-tokens-stddev", "0", "--random-seed", "0",
            "--output-artifact-dir", str(tmp_path), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
            "--workers-max", "2", "--use-server-token-count",
        ],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    export = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert export["request_count"]["avg"] == 20 and export.get("error_request_count", {"avg": 0})["avg"] == 0
    # the counts are the server's (stream_options.include_usage): the chat template's tokens on top of the 24
    assert export["input_sequence_length"]["min"] > 24 and 1 <= export["output_sequence_length"]["min"]
    assert export["output_sequence_length"]["max"] <= 12  # max_completion_tokens honoured
