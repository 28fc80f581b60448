"""The monolithic server through its HTTP API, as a user drives it: OpenAI client, SGLang /generate,
streaming, n > 1, logprobs, bad input, aborts; pool integrity after everything."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest

from tests.conftest import start_server
from tests.integration.test_structured_output import BUILTIN


@pytest.fixture(scope="module")
def server(reference_servers):
    return reference_servers.get(*BUILTIN)  # the full model: "Paris", a stop string met


@pytest.fixture(autouse=True)
def pools_idle_after(server):
    yield
    server.wait_idle()


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def test_openai_client_streams_a_chat_completion(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert text == full.choices[0].message.content
    assert "Paris" in text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens > 0


def test_generate_stream_ends_with_the_non_stream_result(server):
    body = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    whole = post(server, "/generate", body).json()
    events = []
    with httpx.stream("POST", server.url + "/generate", json=body | {"stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events[-1]["text"] == whole["text"]
    assert events[-1]["output_ids"] == whole["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "matched": None}
    assert len(whole["output_ids"]) == 10


def test_n_choices_with_seeds_are_reproducible(server):
    body = {"prompt": "Tell me a story.", "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7, "ignore_eos": True}
    a = post(server, "/v1/completions", body).json()
    b = post(server, "/v1/completions", body).json()
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert sorted(c["index"] for c in a["choices"]) == [0, 1, 2]
    assert a["usage"]["completion_tokens"] == 24


def test_logprobs_match_between_generate_and_top_logprobs(server):
    body = {
        "text": "Paris is the capital of",
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
    }
    meta = post(server, "/generate", body).json()["meta_info"]
    out = meta["output_token_logprobs"]
    tops = meta["output_top_logprobs"]
    assert len(out) == 3
    for (lp, tok, _), top in zip(out, tops):
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp, abs=1e-5)  # greedy: chosen = best
        assert top[0][0] >= top[1][0]
    inputs = meta["input_token_logprobs"]
    assert inputs[0][0] is None and all(isinstance(x[0], float) and x[0] <= 0 for x in inputs[1:])


def test_stop_string_is_trimmed_and_reported(server):
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 20, "temperature": 0, "stop": [" 8"]}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == " 6, 7,"


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}}, "sampling_params.max_new_tokens"),
        ("/generate", {"text": ""}, "text"),
        ("/generate", {"input_ids": []}, "input_ids"),
        ("/generate", {"input_ids": [1, 999999]}, "input_ids"),
        ("/generate", {"input_ids": [1] * 5000}, "input_ids"),
        ("/generate", {"text": 5}, "text"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-5"}, "model"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(server, path, body, field):
    r = post(server, path, body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    assert err["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"text": "\xff\xfe"}'])
def test_malformed_bodies_are_400(server, raw):
    r = httpx.post(server.url + "/generate", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "body"


def test_client_disconnect_mid_stream_frees_the_request(server):
    body = {
        "text": "Count slowly:",
        "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    server.wait_idle()


def test_health_generate_and_metrics(server):
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert "tandem_time_to_first_token_seconds_count" in metrics
    assert "tandem_kv_pages_total" in metrics


def test_full_queue_answers_503_with_retry_after():
    s = start_server("--max-queued-requests", "1", "--max-running-requests", "1", name="tiny-queue").wait_ready()
    body = {"text": "Count:", "sampling_params": {"max_new_tokens": 150, "ignore_eos": True, "temperature": 0}}
    queued = body | {"sampling_params": body["sampling_params"] | {"max_new_tokens": 1}}  # waits all the same
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, s.url + "/generate", json=body, timeout=120)
            while s.info()["num_running_reqs"] < 1:
                time.sleep(0.05)
            second = pool.submit(httpx.post, s.url + "/generate", json=queued, timeout=120)
            while s.info()["num_waiting_reqs"] < 1:  # running 1, queued 1: the queue is full
                time.sleep(0.05)
            r = httpx.post(s.url + "/generate", json=body, timeout=60)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "overloaded_error"
            assert first.result().status_code == second.result().status_code == 200
        s.wait_idle()
    finally:
        s.stop()
