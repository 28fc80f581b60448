"""The router over TLS with keys, against HTTPS workers that require a key on every path (/health included):
benchmarks/router_mock.py processes (fixed answers), certificates made by the test (tests/integration/tls_certs.py).
The router serves HTTPS (--ssl-certfile/--ssl-keyfile), verifies the workers with --ssl-ca-certs and sends
them --worker-api-key, which is not the key its own clients send (--api-key)."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.conftest import ROOT, ServerProcess, free_port
from tests.integration.tls_certs import Certs, make_certs

sys.path.insert(0, str(ROOT))
from benchmarks.router_mock import bodies  # noqa: E402

CLIENT_KEY, WORKER_KEY = "ck-0c1d2e3f", "wk-9a8b7c6d"
ANSWERS = bodies(16)
GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 16}}
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


@dataclass
class TLSCluster:
    certs: Certs
    prefill: str  # https://127.0.0.1:PORT
    decode: str
    router: ServerProcess

    def client(self, key: str | None = CLIENT_KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        verify = ssl.create_default_context(cafile=str(self.certs.ca))
        return httpx.Client(base_url=self.router.url, headers=headers, verify=verify, timeout=10)


def start_router(prefill: str, decode: str, *flags: str, name: str) -> ServerProcess:
    port = free_port()
    args = ["router", "--prefill", prefill, "8998", "--decode", decode, "--port", str(port), *flags]
    return ServerProcess([*args, "--health-check-interval-s", "0.3"], port, name=name, health="/readiness")


def wait_ready(router: ServerProcess, certs: Certs) -> ServerProcess:
    """Until /readiness answers 200 over HTTPS: both workers passed a health check with the key, over TLS."""
    router.url = router.url.replace("http://", "https://")
    verify = ssl.create_default_context(cafile=str(certs.ca))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert router.proc.poll() is None, router.log_tail()
        try:
            if httpx.get(router.url + "/readiness", verify=verify, timeout=2).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{router.name} not ready:\n{router.log_tail()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[TLSCluster]:
    certs = make_certs(tmp_path_factory.mktemp("tls"))
    tls = ("--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key))
    mocks, urls = [], []
    for role in ("prefill", "decode"):
        port = free_port()
        cmd = [sys.executable, str(ROOT / "benchmarks" / "router_mock.py"), "--role", role, "--port", str(port)]
        mocks.append(subprocess.Popen([*cmd, "--api-key", WORKER_KEY, *tls]))
        urls.append(f"https://127.0.0.1:{port}")
    keys = ("--api-key", CLIENT_KEY, "--worker-api-key", WORKER_KEY)
    router = start_router(*urls, *keys, *tls, "--ssl-ca-certs", str(certs.ca), name="tls-router")
    try:
        yield TLSCluster(certs, *urls, wait_ready(router, certs))
    finally:
        router.stop()
        for m in mocks:
            m.terminate()
            m.wait(10)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", [("/generate", GEN), ("/v1/chat/completions", CHAT)])
def test_https_router_relays_https_workers_answers_byte_for_byte(cluster, path, body, stream):
    with cluster.client() as c:
        r = c.post(path, json=body | {"stream": stream})
    assert r.status_code == 200, r.text
    assert r.content == b"".join(ANSWERS[path, stream])


def test_every_worker_call_carries_the_worker_key_over_tls(cluster):
    with cluster.client() as c:
        assert c.get("/health_generate").status_code == 200
        assert c.get("/v1/models").json()["data"][0]["id"] == "mock"
        info = c.get("/get_server_info").json()
        workers = c.get("/workers").json()["workers"]
    assert [(w["url"], w.get("role"), w.get("error")) for w in info["prefill"] + info["decode"]] == [
        (cluster.prefill, "mock", None),
        (cluster.decode, "mock", None),
    ]
    assert [(w["healthy"], w["failures"]) for w in workers] == [(True, 0), (True, 0)]


@pytest.mark.parametrize("key", [None, WORKER_KEY, CLIENT_KEY + "x"])
def test_a_client_without_the_client_key_is_401_at_the_router(cluster, key):
    with cluster.client(key) as c:
        for r in (c.post("/generate", json=GEN), c.get("/health_generate"), c.get("/v1/models")):
            assert r.status_code == 401 and r.json()["error"]["param"] == "authorization"


def test_plain_http_to_the_routers_tls_port_is_a_400_naming_the_scheme(cluster):
    r = httpx.get(cluster.router.url.replace("https://", "http://") + "/health", timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "scheme", r.text
    assert "use https://" in r.json()["error"]["message"]
    with cluster.client() as c:  # and the port still speaks TLS
        assert c.get("/health").status_code == 200


def test_workers_whose_certificate_the_router_cannot_verify_are_never_used(cluster):
    """A router without --ssl-ca-certs verifies with the system's CAs, which never signed the test's CA."""
    router = start_router(cluster.prefill, cluster.decode, "--worker-api-key", WORKER_KEY, name="tls-untrusted")
    router.health = "/health"  # up, never ready
    try:
        router.wait_ready(60)
        time.sleep(1.0)  # a few health checks
        workers = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
        assert [w["healthy"] for w in workers] == [False, False] and all(w["failures"] >= 2 for w in workers)
        assert httpx.get(router.url + "/readiness", timeout=5).status_code == 503
        r = httpx.post(router.url + "/generate", json=GEN, timeout=10)
        assert r.status_code == 503 and "no healthy prefill and decode worker pair" in r.json()["error"]["message"]
    finally:
        router.stop()
