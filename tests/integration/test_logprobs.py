"""Logprobs of prompt and output tokens through the PD router equal the monolithic server's, streamed and
not, on SGLang's /generate (input_token_logprobs, input_top_logprobs) and OpenAI's /v1/completions (echo
with logprobs: the prompt's tokens first). Only the prefill runs the prompt through the model, so the
router merges its values into the decode's answer; the monolithic server streams them from the first
event on. Token ids and strings are compared exactly, logprobs within 1e-4."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.integration.cluster import start_cluster
from tests.integration.test_parity_hf import LONG_TEXT

FLAGS = ("--page-size", "16", "--chunked-prefill-size", "64")  # the 90-token prompt is prefilled in two chunks
TOL = 1e-4


@pytest.fixture(scope="module")
def prompt(builtin_model_dir) -> list[int]:
    ids = AutoTokenizer.from_pretrained(builtin_model_dir).encode(LONG_TEXT)[:90]
    assert len(ids) == 90
    return ids


@pytest.fixture(scope="module")
def mono(reference_servers):
    return reference_servers.get(*FLAGS)  # test_pd.py's


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster("mooncake", flags=FLAGS)
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def idle_after(mono, cluster):
    yield
    for node in (mono, *cluster.nodes):
        node.wait_idle()


def post(url: str, path: str, body: dict) -> Any:
    r = httpx.post(url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events and all("error" not in e for e in events), events
    return events


def assert_close(got: Any, want: Any, where: str = "") -> None:
    """Equal structures: numbers within TOL, everything else exactly (None, token ids, strings)."""
    if isinstance(want, float) and not isinstance(want, bool):
        assert isinstance(got, float) and abs(got - want) <= TOL, f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys {got} != {want}"
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def generate_body(prompt: list[int]) -> dict:
    return {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
    }


def logprob_fields(result: dict) -> dict:
    meta = result["meta_info"]
    keys = ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs")
    return {"output_ids": result["output_ids"]} | {k: meta[k] for k in keys}


def test_generate_merges_the_prefills_input_logprobs_and_equals_monolithic(mono, cluster, prompt):
    want = post(mono.url, "/generate", generate_body(prompt))
    got = post(cluster.url, "/generate", generate_body(prompt))
    assert_close(logprob_fields(got), logprob_fields(want), "generate")
    inputs, tops = want["meta_info"]["input_token_logprobs"], want["meta_info"]["input_top_logprobs"]
    assert [t for _, t, _ in inputs] == prompt and inputs[0][0] is None and tops[0] is None
    assert all(lp <= 0 for lp, _, _ in inputs[1:]) and all(len(top) == 3 for top in tops[1:])
    # every top list is sorted and holds the best token: greedy output tokens are their own top 1
    for (lp, tok, _), top in zip(want["meta_info"]["output_token_logprobs"], want["meta_info"]["output_top_logprobs"]):
        assert top[0][1] == tok and abs(top[0][0] - lp) <= TOL and top[0][0] >= top[1][0] >= top[2][0]


def test_generate_stream_carries_input_logprobs_from_the_first_event_and_equals_monolithic(mono, cluster, prompt):
    whole = logprob_fields(post(mono.url, "/generate", generate_body(prompt)))
    inputs = {k: whole[k] for k in ("input_token_logprobs", "input_top_logprobs")}
    for url in (mono.url, cluster.url):  # how many events a stream has depends on timing; what they hold does not
        events = [logprob_fields(e) for e in stream(url, "/generate", generate_body(prompt))]
        assert events[0]["output_ids"] == whole["output_ids"][:1]
        for i, event in enumerate(events):
            assert_close({k: event[k] for k in inputs}, inputs, f"{url} event {i}")
        assert_close(events[-1], whole, f"{url} last event")


@pytest.mark.parametrize("echo", [True, False])
def test_completions_logprobs_with_and_without_echo_equal_monolithic(mono, cluster, prompt, echo):
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": echo}
    want, got = post(mono.url, "/v1/completions", body), post(cluster.url, "/v1/completions", body)
    assert_close(got["choices"], want["choices"], "choices")
    logprobs = want["choices"][0]["logprobs"]
    n = len(prompt) + 5 if echo else 5
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == n
    if echo:
        text = want["choices"][0]["text"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(isinstance(x, float) for x in logprobs["token_logprobs"][1:])
        assert "".join(logprobs["tokens"]) == text and text.startswith(LONG_TEXT[:40])
        assert logprobs["text_offset"][len(prompt)] == len("".join(logprobs["tokens"][: len(prompt)]))


def flattened(chunks: list[dict]) -> dict:
    """A completion stream's choice 0 as one: its text and its logprobs, chunk after chunk."""
    parts = [e["choices"][0] for e in chunks]
    return {"text": "".join(p["text"] for p in parts)} | {
        k: [x for p in parts for x in p["logprobs"][k]] for k in ("tokens", "token_logprobs", "top_logprobs")
    }


def test_completions_stream_with_echo_equals_monolithic(mono, cluster, prompt):
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True}
    whole = post(mono.url, "/v1/completions", body)["choices"][0]
    want = {"text": whole["text"]} | {k: whole["logprobs"][k] for k in ("tokens", "token_logprobs", "top_logprobs")}
    for url in (mono.url, cluster.url):
        chunks = stream(url, "/v1/completions", body)
        assert len(chunks[0]["choices"][0]["logprobs"]["tokens"]) > len(prompt)  # the prompt comes first, whole
        assert_close(flattened(chunks), want, url)
