"""Agent frameworks against the PD router, unchanged but for base_url (the packages pinned in the test extra):
the OpenAI Agents SDK with its Responses model and its Chat Completions model (a forced function tool, a
typed output), LangChain's ChatOpenAI (invoke, stream, with_structured_output by json_schema and by
function_calling, bind_tools, the Responses API), pydantic-ai with a typed output on both APIs. The model is
tiny: tools are forced where the client allows; what is judged is the protocol (every call answered, every
typed output validated by the client's own parser)."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.test_responses_api import CLUSTER_USERS, City, model  # noqa: F401 (a fixture)
from tests.integration.test_structured_output import BUILTIN

ASK = "What is the weather in Paris?"


class Trip(BaseModel):
    """A nested model: its schema has $defs and a $ref, as the frameworks send them."""

    city: City
    days: int = Field(ge=1, le=30)


@pytest.fixture(scope="module")
def mono(reference_servers):
    return reference_servers.get(*BUILTIN)


@pytest.fixture(scope="module")
def cluster(shared_clusters):
    c = shared_clusters.get("mooncake", BUILTIN)
    yield c
    shared_clusters.done("mooncake", BUILTIN, CLUSTER_USERS)


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
