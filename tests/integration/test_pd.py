"""PD disaggregation end to end: router -> prefill -> (Mooncake | NIXL) -> decode, checked token for
token against the monolithic server, with every node's pool back to idle after each test."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.integration.cluster import generate
from tests.integration.test_parity_hf import LONG_TEXT

FLAGS = {
    "mooncake": ("--page-size", "16", "--chunked-prefill-size", "64"),
    "nixl": ("--page-size", "1", "--chunked-prefill-size", "0"),
}
CLUSTER_USERS = 2  # modules sharing each backend's cluster (conftest.SharedClusters): this one and test_tp_pd


@pytest.fixture(scope="module")
def prompts(builtin_model_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(builtin_model_dir)

    def chat(content: str) -> list[int]:
        messages = [{"role": "user", "content": content}]
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])

    out = [
        chat("What is the capital of France?"),
        chat("Name three colours."),
        chat("Summarise:\n" + LONG_TEXT),
        tok.encode("def quicksort(arr):"),
        tok.encode("The weather today is"),
        tok.encode(LONG_TEXT + " Therefore,"),
        tok.encode("A"),
    ]
    out.append(
        out[5][:200] + tok.encode(" In short,")
    )  # shares a long prefix with an earlier prompt: radix hit on prefill
    return out


@pytest.fixture(scope="module")
def mono(reference_servers):
    return reference_servers.get("--page-size", "16", "--chunked-prefill-size", "64")


@pytest.fixture(scope="module")
def expected(mono, prompts) -> list[list[int]]:
    return [generate(mono.url, p)["output_ids"] for p in prompts]


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def cluster(request, shared_clusters):
    """The TP 1 pair of each backend, shared with test_tp_pd (CLUSTER_USERS modules)."""
    c = shared_clusters.get(request.param, FLAGS[request.param])
    yield c
    shared_clusters.done(request.param, FLAGS[request.param], CLUSTER_USERS)


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").wait_idle()


def test_greedy_tokens_equal_monolithic(cluster, prompts, expected):
    for ids, want in zip(prompts, expected):
        got = generate(cluster.url, ids)
        assert got["output_ids"] == want, f"prompt of {len(ids)} tokens diverged"
    assert max(len(p) for p in prompts) > 64  # longer than the chunked-prefill size
    again = generate(cluster.url, prompts[5])
    assert again["meta_info"]["cached_tokens"] >= len(prompts[5]) - 16  # prefill's radix cache was hit
    assert again["output_ids"] == expected[5]


def test_n_greater_than_one_gives_identical_greedy_choices(cluster, prompts, expected):
    body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 16, "temperature": 0, "n": 2}}
    r = httpx.post(cluster.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert [c["output_ids"] for c in r.json()] == [expected[0], expected[0]]


def test_seeded_sampling_equals_monolithic(cluster, mono, prompts):
    """A seeded request's random stream follows its token count, so a prefill (first token) and a decode
    (the rest) draw what one monolithic server draws."""
    params = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": 1234, "repetition_penalty": 1.1}
    outs = [
        httpx.post(url + "/generate", json={"input_ids": prompts[4], "sampling_params": params}, timeout=120)
        for url in (mono.url, cluster.url)
    ]
    assert [r.status_code for r in outs] == [200, 200], outs[1].text
    ref, got = (r.json()["output_ids"] for r in outs)
    assert got == ref and len(set(ref)) > 4


def test_openai_client_streams_through_the_router(cluster, mono):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chunks = list(
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=msgs,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref = openai.OpenAI(base_url=mono.url + "/v1", api_key="none").chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=12, temperature=0
    )
    assert text == ref.choices[0].message.content and text
    assert chunks[-1].usage.completion_tokens == ref.usage.completion_tokens


def test_logprobs_merge_prefill_inputs_and_equal_monolithic(cluster, mono, prompts):
    extra = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    pd = generate(cluster.url, prompts[3], max_new=4, **extra)["meta_info"]
    ref = generate(mono.url, prompts[3], max_new=4, **extra)["meta_info"]
    assert [t for _, t, _ in pd["output_token_logprobs"]] == [t for _, t, _ in ref["output_token_logprobs"]]
    for (a, _, _), (b, _, _) in zip(pd["output_token_logprobs"], ref["output_token_logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)
    assert len(pd["input_token_logprobs"]) == len(prompts[3]) and pd["input_token_logprobs"][0][0] is None
    for (a, ta, _), (b, tb, _) in zip(pd["input_token_logprobs"][1:], ref["input_token_logprobs"][1:]):
        assert ta == tb and a == pytest.approx(b, abs=1e-4)


def test_generate_stream_through_router_ends_with_exact_tokens(cluster, prompts, expected):
    body = {"input_ids": prompts[1], "sampling_params": {"max_new_tokens": 16, "temperature": 0}, "stream": True}
    events = []
    with httpx.stream("POST", cluster.url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert len(events) > 1 and events[-1]["output_ids"] == expected[1]


def test_bad_input_through_the_router_is_a_4xx_and_leaks_nothing(cluster):
    r = httpx.post(cluster.url + "/generate", json={"text": "hi", "sampling_params": {"top_p": 7}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.top_p"
    r = httpx.post(
        cluster.url + "/v1/completions", content=b"{oops", headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


@pytest.mark.parametrize("cluster", ["mooncake"], indirect=True)
def test_sglang_router_drives_a_tandem_pair(cluster, mono, prompts, expected):
    """SGLang's own PD router (sglang-router on PyPI) pairs Tandem nodes through the same fields."""
    pytest.importorskip("sglang_router")
    from tests.conftest import free_port

    port = free_port()
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    boot = cluster.prefill_bootstrap_ports[0]
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill",
            prefill.url,
            str(boot),
            "--decode",
            decode.url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "round_robin",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/readiness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "sglang-router did not become ready"
            time.sleep(0.5)
        for ids, want in list(zip(prompts, expected))[:3]:
            assert generate(url, ids)["output_ids"] == want
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        chats = [httpx.post(u + "/v1/chat/completions", timeout=120, json=body) for u in (url, mono.url)]
        assert [c.status_code for c in chats] == [200, 200], chats[0].text
        got, want = (c.json()["choices"][0]["message"]["content"] for c in chats)
        assert got == want and got
    finally:
        router.terminate()
        router.wait(10)


@pytest.mark.parametrize("cluster", ["mooncake"], indirect=True)
def test_router_workers_can_be_added_and_removed_at_run_time(cluster, prompts, expected):
    from tests.conftest import ServerProcess, free_port

    port = free_port()
    router = ServerProcess(
        ["router", "--port", str(port), "--health-check-interval-s", "0.5"], port, name="router-empty"
    ).wait_ready()
    try:
        url = router.url
        assert httpx.get(url + "/readiness", timeout=5).status_code == 503
        r = httpx.post(url + "/generate", json={"input_ids": prompts[0]}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        boot = cluster.prefill_bootstrap_ports[0]
        assert httpx.post(
            url + "/workers",
            json={"url": cluster.prefills[0].url, "role": "prefill", "bootstrap_port": boot},
            timeout=30,
        ).json()["healthy"]
        assert httpx.post(url + "/workers", json={"url": cluster.decodes[0].url, "role": "decode"}, timeout=30).json()[
            "healthy"
        ]
        assert httpx.get(url + "/readiness", timeout=5).status_code == 200
        assert generate(url, prompts[0])["output_ids"] == expected[0]
        assert (
            httpx.request("DELETE", url + "/workers", json={"url": cluster.decodes[0].url}, timeout=5).status_code
            == 200
        )
        assert httpx.get(url + "/readiness", timeout=5).status_code == 503
        for bad, param in (
            ({"role": "decode"}, "url"),
            ([], "body"),
            ({"url": "not a url", "role": "decode"}, "url"),
            ({"url": "http://h:1", "role": "router"}, "role"),
            ({"url": "http://h:1"}, "role"),
            ({"url": "http://h:1", "role": "prefill", "bootstrap_port": "x"}, "bootstrap_port"),
            ({"url": "http://h:1", "role": "prefill", "bootstrap_host": ["a"]}, "bootstrap_host"),
        ):
            r = httpx.post(url + "/workers", json=bad, timeout=5)
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), (bad, r.text)
        assert len(httpx.get(url + "/workers", timeout=5).json()["workers"]) == 1
    finally:
        router.stop()
