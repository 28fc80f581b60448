"""The README's keyed setup, as a user runs it: a prefill and a decode with `--api-key K --cluster-secret S`,
a router with `--api-key K` (the built-in model, Mooncake over TCP). The router sends K to its workers on
every call (generations, /health_generate, /v1/models, /get_server_info, health checks), also to a worker
added through /workers; a client without K gets 401 at the router and at the servers; a router whose key
for its workers is wrong answers 502 naming the flag."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServerProcess, metric
from tests.integration.cluster import Cluster, start_cluster, start_router

KEY = "tk-5e6f7a8b9c0d"
AUTH = {"Authorization": f"Bearer {KEY}"}
KEYED = ("--api-key", KEY, "--cluster-secret", "s-1f2e3d4c")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(flags=KEYED, router_flags=("--api-key", KEY))
    yield c
    for node in c.nodes:  # no KV page is held once every request ended
        pages = httpx.get(node.url + "/get_server_info", headers=AUTH, timeout=10).json()["kv_pages"]
        assert pages["in_use"] == pages["locked"] == 0, (node.name, pages)
    c.stop()


def text_of(path: str, answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if path == "/v1/chat/completions" else choice["text"]


def streamed_text(path: str, lines: Iterator[str]) -> str:
    parts = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[6:])["choices"][0]
            parts.append(choice["delta"].get("content") or "" if path == "/v1/chat/completions" else choice["text"])
    return "".join(parts)


@pytest.mark.parametrize(
    "path,body",
    [("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "The capital of France is"})],
)
def test_keyed_cluster_serves_chat_and_completions_streaming_and_not(cluster, path, body):
    body = body | {"model": "default", "max_tokens": 8, "temperature": 0}
    r = httpx.post(cluster.url + path, json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    with httpx.stream("POST", cluster.url + path, json=body | {"stream": True}, headers=AUTH, timeout=120) as s:
        assert s.status_code == 200
        streamed = streamed_text(path, s.iter_lines())
    assert streamed == text_of(path, r.json()) and r.json()["usage"]["completion_tokens"] >= 1


def test_health_generate_and_the_workers_info_pass_the_key_on(cluster):
    assert httpx.get(cluster.url + "/health_generate", headers=AUTH, timeout=60).status_code == 200
    assert httpx.get(cluster.url + "/v1/models", headers=AUTH, timeout=30).status_code == 200
    info = httpx.get(cluster.url + "/get_server_info", headers=AUTH, timeout=30).json()
    assert [("error" in w, w["config"]["disaggregation_mode"]) for w in info["prefill"] + info["decode"]] == [
        (False, "prefill"),
        (False, "decode"),
    ]
    assert KEY not in json.dumps(info)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_a_client_without_the_key_gets_401_at_the_router_and_at_the_servers(cluster, headers):
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 2}
    for url in (cluster.url, cluster.prefills[0].url, cluster.decodes[0].url):
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["param"] == "authorization", (url, r.text)
    assert httpx.get(cluster.url + "/health_generate", headers=headers, timeout=30).status_code == 401


def test_a_worker_added_through_workers_gets_the_key_too(cluster):
    decode = cluster.decodes[0].url
    assert httpx.request("DELETE", cluster.url + "/workers", json={"url": decode}, headers=AUTH).status_code == 200
    assert httpx.get(cluster.url + "/readiness", timeout=10).status_code == 503
    added = httpx.post(cluster.url + "/workers", json={"url": decode, "role": "decode"}, headers=AUTH, timeout=30)
    assert added.json()["healthy"] is True
    r = httpx.post(cluster.url + "/generate", json={"text": "Hello", "max_new_tokens": 4}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_a_router_whose_key_the_workers_refuse_answers_502_naming_the_flag(cluster):
    prefill = (cluster.prefills[0], cluster.prefill_bootstrap_ports[0])
    router: ServerProcess = start_router([prefill], cluster.decodes, "--worker-api-key", "wrong", name="wrong-key")
    try:
        r = httpx.post(router.url + "/generate", json={"text": "Hello"}, timeout=60)
        assert r.status_code == 502, r.text
        message = r.json()["error"]["message"]
        assert "refused the router's key (HTTP 401)" in message and "--worker-api-key" in message
        causes = [
            metric(router.url, "tandem_router_cancelled_requests_total", cause=c)
            for c in ("prefill_failed", "decode_failed")
        ]
        assert sum(causes) == 1
    finally:
        router.stop()
