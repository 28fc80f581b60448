"""The TLS listener every Tandem HTTP port shares (common/edge/tls.py), on a standalone bootstrap registry
(no model to load), standalone and embedded as a prefill runs it: it serves HTTPS to a client that trusts its CA, answers plain HTTP with a 400 naming
the scheme (a decode told so by its lookup), refuses a client that does not trust the certificate, and a
certificate that does not load stops the process naming the file. The keyed, encrypted cluster with every
server on its own address is tests/integration/test_netns_keyed_tls.py."""

from __future__ import annotations

import httpx
import pytest

from bootstrap.app import start_in_thread
from bootstrap.client import lookup_prefill, register_prefill
from common.edge.tls import client_verify, server_context
from tests.conftest import ServerProcess, free_port
from tests.integration.tls_certs import make_certs

SECRET = "tls-test-secret"
ENTRY = {"role": "Prefill", "tp_size": 1, "tp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 9}
ENTRY |= {"page_size": 4, "num_layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "float32"}
ENTRY |= {"transfer_backend": "mooncake", "model_id": "0123456789abcdef", "attention": "mha", "kv_scales": "none"}


@pytest.fixture(scope="module")
def boot(tmp_path_factory):
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    port = free_port()
    tls = ["--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key)]
    args = ["bootstrap", "--port", str(port), "--cluster-secret", SECRET, *tls]
    proc = ServerProcess(args, port, name="tls-boot", tls_ca=str(certs.ca))
    try:
        proc.wait_ready(60)
        register_prefill(proc.url, ENTRY, SECRET, verify=str(certs.ca))
        yield proc
    finally:
        proc.stop()


def test_a_client_that_trusts_the_ca_is_served_over_https(boot):
    assert lookup_prefill(boot.url, None, SECRET, httpx.Client(verify=boot.verify))["rank_port"] == 9


def test_plain_http_to_the_tls_port_is_a_400_naming_the_scheme(boot):
    r = httpx.get(boot.url.replace("https://", "http://") + "/health", timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("scheme", 400) and "use https://" in err["message"]
    assert httpx.get(boot.url + "/health", verify=boot.verify, timeout=10).status_code == 200  # still TLS


def test_a_decode_that_looks_up_over_plain_http_is_told_to_use_https(boot):
    with pytest.raises(RuntimeError, match="answered 400: this port speaks HTTPS.*use https://"):
        lookup_prefill(boot.url.replace("https://", "http://"), None, SECRET)


def test_a_client_that_does_not_trust_the_certificate_cannot_connect(boot):
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(boot.url + "/health", timeout=10)  # the system's CAs: the test's CA is not among them


def test_a_bootstrap_whose_certificate_does_not_load_says_which_file(tmp_path):
    port = free_port()
    missing = str(tmp_path / "nope.pem")
    proc = ServerProcess(["bootstrap", "--port", str(port), "--ssl-certfile", missing], port, name="tls-boot-bad")
    assert proc.proc.wait(60) != 0
    assert f"--ssl-certfile {missing}" in proc.log_path.read_text()
    proc.stop()


def test_the_registry_embedded_in_a_prefill_serves_https_and_refuses_plain_http(tmp_path):
    """In this process, as a prefill runs it (its own thread; it serves until the process exits)."""
    certs, port = make_certs(tmp_path), free_port()
    start_in_thread("127.0.0.1", port, SECRET, server_context(str(certs.cert), str(certs.key)))
    url = f"https://127.0.0.1:{port}"
    register_prefill(url, ENTRY, SECRET, verify=str(certs.ca))
    assert lookup_prefill(url, None, SECRET, httpx.Client(verify=client_verify(str(certs.ca))))["rank_port"] == 9
    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "scheme", r.text
