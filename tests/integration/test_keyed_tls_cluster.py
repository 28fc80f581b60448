"""A keyed, encrypted PD pair (tiny model, real processes): API key, cluster secret and TLS on every server,
certificates from a CA the test makes. PD over HTTPS gives the monolithic server's greedy tokens; plain
HTTP to any TLS port is a 400 naming the scheme; and every port that speaks HTTP or ZMQ refuses an
unauthenticated call (401, or a dropped and counted frame). The transfer engines' data ports are not
authenticated (docs/architecture.md: close them with the chart's NetworkPolicy)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import zmq

from bootstrap.client import lookup_prefill, register_prefill
from bootstrap.signing import SIGNATURE_HEADER, sign
from common.http.app import OPEN_PATHS, create_app
from tests.conftest import ServerProcess, free_port, start_server
from tests.integration.faults import wait_until
from tests.integration.tiny_model import random_prompts
from tests.integration.tls_certs import Certs, make_certs
from transfer.messages import Ping, Register, Status, encode

API_KEY = "tls-test-key"
SECRET = "tls-test-secret"
FLAGS = ("--page-size", "4", "--chunked-prefill-size", "32", "--api-key", API_KEY, "--cluster-secret", SECRET)
PROMPTS = random_prompts(3, 8, 30, seed=11)
NEW = 8


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


class TlsPair:
    def __init__(self, model: str, certs: Certs):
        tls = ("--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key), "--ssl-ca-certs", str(certs.ca))
        common = ("--model", model, "--transfer-backend", "mooncake", *FLAGS, *tls)
        self.boot_port = free_port()  # the prefill's embedded bootstrap, TLS too
        self.mono = start_server("--model", model, *FLAGS, *tls, name="tls-mono", tls_ca=str(certs.ca))
        self.prefill = start_server(
            "--disagg-mode",
            "prefill",
            "--bootstrap-port",
            str(self.boot_port),
            *common,
            name="tls-prefill",
            tls_ca=str(certs.ca),
        )
        self.decode = start_server("--disagg-mode", "decode", *common, name="tls-decode", tls_ca=str(certs.ca))
        self.servers = [self.mono, self.prefill, self.decode]
        for s in self.servers:
            s.wait_ready()
        self.boot_url = f"https://127.0.0.1:{self.boot_port}"
        self.verify = self.prefill.verify

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@pytest.fixture(scope="module")
def pair(tiny_model_dir, certs):
    p = TlsPair(str(tiny_model_dir), certs)
    yield p
    p.stop()


def post(server: ServerProcess, body: dict, path: str = "/generate") -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.auth, verify=server.verify, timeout=120)


def pd_generate(pair: TlsPair, ids: list[int], room: int, stream: bool = False) -> list[int]:
    """One request as a router sends it: the same body with the rendezvous to the prefill and the decode."""
    rendezvous = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pair.boot_port,
        "bootstrap_room": room,
        "prefill_instance_id": pair.prefill.info()["role"]["instance_id"],
    }
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}, "stream": stream}
    with ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(post, pair.prefill, body | rendezvous)
        decode = pool.submit(post, pair.decode, body | rendezvous)
        assert prefill.result().status_code == 200, prefill.result().text
        r = decode.result()
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["output_ids"]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return events[-1]["output_ids"]


def test_pd_over_tls_gives_the_monolithic_tokens(pair):
    for i, ids in enumerate(PROMPTS):
        r = post(pair.mono, {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}})
        assert r.status_code == 200, r.text
        want = r.json()["output_ids"]
        assert pd_generate(pair, ids, room=1000 + i) == want
        assert pd_generate(pair, ids, room=2000 + i, stream=True) == want
    for s in (pair.prefill, pair.decode):
        s.wait_idle()


def plain_urls(pair: TlsPair) -> list[str]:
    return [s.url.replace("https://", "http://") for s in pair.servers] + [f"http://127.0.0.1:{pair.boot_port}"]


def test_plain_http_to_a_tls_port_is_a_400_naming_the_scheme(pair):
    for url in plain_urls(pair):
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 400, url
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("scheme", 400)
        assert "use https://" in err["message"]
    for s in pair.servers:  # and the port still speaks TLS
        assert httpx.get(s.url + "/health", verify=s.verify, timeout=10).status_code == 200


def test_a_decode_that_looks_up_over_plain_http_is_told_to_use_https(pair):
    with pytest.raises(RuntimeError, match="answered 400: this port speaks HTTPS.*use https://"):
        lookup_prefill(f"http://127.0.0.1:{pair.boot_port}", None, SECRET)
    assert lookup_prefill(pair.boot_url, None, SECRET, httpx.Client(verify=pair.verify))["rank_port"] > 0


def test_a_client_that_does_not_trust_the_certificate_cannot_connect(pair):
    for url in [s.url for s in pair.servers] + [pair.boot_url]:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url + "/health", timeout=10)  # the system's CAs: the test's CA is not among them


def engine_routes() -> list[tuple[str, str]]:
    """Every (method, path) an engine server answers, from the app itself, so a new route is walked too."""
    stub = SimpleNamespace(config=SimpleNamespace(api_key="k", max_request_bytes=1), metrics=None)
    return [(m, r.path) for r in create_app(stub).routes for m in sorted(r.methods) if m != "HEAD"]


def test_every_http_route_of_every_server_refuses_a_call_without_the_key(pair):
    routes = engine_routes()
    assert ("POST", "/generate") in routes and ("GET", "/docs") in routes
    for s in pair.servers:
        for method, path in routes:
            r = httpx.request(method, s.url + path, json={}, verify=s.verify, timeout=30)
            want = 200 if path in OPEN_PATHS else 401
            assert r.status_code == want, f"{s.name} {method} {path}: {r.status_code} {r.text[:200]}"


@pytest.mark.parametrize("method", ["PUT", "GET", "DELETE"])
@pytest.mark.parametrize("signature", ["unsigned", "wrong-secret"])
def test_every_bootstrap_route_refuses_an_unsigned_or_forged_call(pair, method, signature):
    path_qs = "/route?engine_rank=0&target_dp_group=0" if method != "PUT" else "/route"
    headers = {} if signature == "unsigned" else {SIGNATURE_HEADER: sign("guess", method, path_qs, b"{}")}
    r = httpx.request(method, pair.boot_url + path_qs, content=b"{}", headers=headers, verify=pair.verify, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["param"] == "signature", r.text
    assert pd_generate(pair, PROMPTS[0], room=3000 + len(method) * 10 + len(signature))  # the prefill stays registered


def rejected_frames(server: ServerProcess) -> float:
    return metric_tls(server, "tandem_kv_transfer_events_total", event="rejected_messages")


def metric_tls(server: ServerProcess, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", verify=server.verify, timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_every_control_port_drops_and_counts_unsigned_and_forged_frames(pair):
    fake = Register("intruder", "tcp://127.0.0.1:1", b"127.0.0.1:1", [4096], [64], 8, 4, 4096, 188, 2)
    frames = [encode(fake, None), encode(fake, "guess"), encode(Status(1, True, ""), None), encode(Ping("x"), "guess")]
    ctx = zmq.Context.instance()
    for server in (pair.prefill, pair.decode):
        before = rejected_frames(server)
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(server.info()["role"]["control_endpoint"])
        for frame in frames:
            sock.send(frame)
        sock.close()
        wait_until(lambda: rejected_frames(server) - before == len(frames), 10, f"{server.name} to count the frames")
    assert pd_generate(pair, PROMPTS[1], room=4000)


def test_a_standalone_bootstrap_serves_https_and_refuses_plain_http(certs):
    port = free_port()
    tls = ["--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key)]
    boot = ServerProcess(
        ["bootstrap", "--port", str(port), "--cluster-secret", SECRET, *tls],
        port,
        name="tls-boot",
        tls_ca=str(certs.ca),
    )
    try:
        boot.wait_ready(60)
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "scheme"
        entry = {"role": "Prefill", "tp_size": 1, "tp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 9}
        entry |= {"page_size": 4, "num_layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "float32"}
        entry |= {
            "transfer_backend": "mooncake",
            "model_id": "0123456789abcdef",
            "attention": "mha",
            "kv_scales": "none",
        }
        register_prefill(boot.url, entry, SECRET, verify=str(certs.ca))
        assert lookup_prefill(boot.url, None, SECRET, httpx.Client(verify=boot.verify))["rank_port"] == 9
    finally:
        boot.stop()


def test_a_bootstrap_whose_certificate_does_not_load_says_which_file(tmp_path):
    port = free_port()
    missing = str(tmp_path / "nope.pem")
    boot = ServerProcess(["bootstrap", "--port", str(port), "--ssl-certfile", missing], port, name="tls-boot-bad")
    assert boot.proc.wait(60) != 0
    assert f"--ssl-certfile {missing}" in boot.log_path.read_text()
    boot.stop()
