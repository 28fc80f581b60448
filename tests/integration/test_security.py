"""An engine server with an API key (TANDEM_API_KEY) and a 4096-byte body limit, over real HTTP:
the key is required, checked and never shown; oversize bodies are refused however they are sent;
every 4xx is counted in /metrics."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import sample, start_server

API_KEY = "tk-3f9a1c0d2b7e4a5f"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LIMIT = 4096
SMALL = {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TANDEM_API_KEY", API_KEY)
        s = start_server("--max-request-bytes", str(LIMIT), "--max-total-tokens", "2048", name="secure")
    yield s.wait_ready()
    s.stop()


def metrics(server) -> str:
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


def assert_error(r: httpx.Response, status: int, param: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (status, param)
    assert err["message"]


def padded_body(size: int) -> bytes:
    """A valid /generate body of exactly `size` bytes (JSON whitespace, so the prompt stays short)."""
    core = httpx.Request("POST", "http://x", json=SMALL).content
    return core[:-1] + b" " * (size - len(core)) + b"}"


def chunked(raw: bytes, piece: int = 500) -> Iterator[bytes]:
    """A generator body: httpx sends it with Transfer-Encoding: chunked and no Content-Length."""
    for i in range(0, len(raw), piece):
        yield raw[i : i + piece]


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="missing"),
        pytest.param({"Authorization": f"Basic {API_KEY}"}, id="wrong-scheme"),
        pytest.param({"Authorization": API_KEY}, id="no-scheme"),
        pytest.param({"Authorization": "Bearer wrong-key"}, id="wrong-key"),
        pytest.param({"Authorization": f"Bearer {API_KEY}x"}, id="key-with-suffix"),
        pytest.param({"Authorization": "Bearer"}, id="empty-key"),
    ],
)
@pytest.mark.parametrize(
    "method,path",
    [("POST", "/generate"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/get_server_info")],
)
def test_missing_or_wrong_key_is_401_naming_authorization(server, headers, method, path):
    r = httpx.request(method, server.url + path, json=SMALL, headers=headers, timeout=30)
    assert_error(r, 401, "authorization")
    assert r.json()["error"]["type"] == "authentication_error"


def test_right_key_is_served(server):
    r = httpx.post(server.url + "/generate", json=SMALL, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 3
    assert (
        httpx.get(server.url + "/v1/models", headers={"Authorization": f"bearer {API_KEY}"}, timeout=10).status_code
        == 200
    )


def test_health_and_metrics_need_no_key(server):
    """Probes carry no key: the kubelet's readiness probe asks /health_generate."""
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    assert "tandem_rejected_inputs_total" in metrics(server)


def test_key_never_leaves_the_server(server):
    info = httpx.get(server.url + "/get_server_info", headers=AUTH, timeout=30)
    assert info.status_code == 200
    assert "api_key" not in info.json()["config"]
    for text in (info.text, metrics(server), server.log_path.read_text(errors="replace")):
        assert API_KEY not in text
    assert re.search(r"api_key += set", server.log_path.read_text())  # the start-up summary says only that it is set


@pytest.mark.parametrize("send", ["content-length", "chunked"])
def test_body_over_the_limit_is_413_however_it_is_sent(server, send):
    raw = padded_body(5000)
    content = raw if send == "content-length" else chunked(raw)
    r = httpx.post(
        server.url + "/generate", content=content, headers=AUTH | {"content-type": "application/json"}, timeout=30
    )
    assert_error(r, 413, "body")
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_endpoints_hold_the_limit_for_chunked_bodies(server, path):
    r = httpx.post(server.url + path, content=chunked(b" " * 5000), headers=AUTH, timeout=30)
    assert_error(r, 413, "body")


def test_chunked_body_under_the_limit_is_served(server):
    r = httpx.post(server.url + "/generate", content=chunked(padded_body(LIMIT)), headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 3


def test_every_4xx_is_counted_once_as_a_rejected_input(server):
    before = metrics(server)
    answers = [
        httpx.post(server.url + "/generate", json=SMALL, timeout=30),  # 401
        httpx.post(server.url + "/generate", content=chunked(padded_body(5000)), headers=AUTH, timeout=30),  # 413
        httpx.post(server.url + "/generate", content=b"{oops", headers=AUTH, timeout=30),  # 400
        httpx.post(
            server.url + "/v1/completions", json={"prompt": "hi", "model": "gpt-x"}, headers=AUTH, timeout=30
        ),  # 404
        httpx.get(server.url + "/no/such/path", headers=AUTH, timeout=30),  # 404
        httpx.get(server.url + "/generate", headers=AUTH, timeout=30),  # 405
        httpx.post(server.url + "/generate", json=SMALL, headers=AUTH, timeout=60),  # 200: not counted
    ]
    assert [r.status_code for r in answers] == [401, 413, 400, 404, 404, 405, 200]
    assert [r.json()["error"]["param"] for r in answers[4:6]] == ["path", "method"]
    after = metrics(server)
    http = {"where": "http", "role": "null"}
    assert (
        sample(after, "tandem_rejected_inputs_total", http) == sample(before, "tandem_rejected_inputs_total", http) + 6
    )
    for status, n in (("401", 1), ("413", 1), ("400", 1), ("405", 1), ("200", 1)):
        labels = {"endpoint": "/generate", "status": status, "role": "null"}
        assert sample(after, "tandem_requests_total", labels) == sample(before, "tandem_requests_total", labels) + n


@pytest.mark.parametrize("size", [5000, 2_000_000])
def test_the_connection_after_a_413_serves_the_next_request(server, size):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        for content in (padded_body(size), chunked(padded_body(size), piece=65536)):
            assert client.post("/generate", content=content).status_code == 413
            r = client.post("/generate", json=SMALL)
            assert r.status_code == 200, r.text
