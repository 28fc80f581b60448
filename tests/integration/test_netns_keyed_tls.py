"""A keyed, encrypted cluster on separate addresses (issue 23's "done when"): router, bootstrap, prefill and
decode each in its own network namespace (tests/integration/netns.py), each host named `<host>.tandem.test`
in every namespace, the API key on every process, the cluster secret, and TLS everywhere from one
certificate that names the hosts' names and none of their addresses. The router finds the prefill by DNS
discovery (https to its address, verified against the discovery name) and is given the decode by POST
/workers (https://decode.tandem.test:8000).

It serves a monolithic server's greedy tokens, streamed and not, and /health_generate passes. Every port
that speaks HTTP or ZMQ, enumerated from the router's /get_server_info (its config, and each worker's config
and control endpoint) and checked against what listens in each namespace, refuses every unauthenticated
call: 401 on each HTTP route but the open probes, 401 on the bootstrap's routes unsigned or forged, a 400
naming the scheme for plain HTTP, forged frames on the control ports dropped and counted. What else listens
is the transfer engines' data ports, which authenticate nothing (docs/wire.md: close them with the
network)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from bootstrap.signing import SIGNATURE_HEADER, sign
from common.config import ServerConfig
from common.http.app import OPEN_PATHS as ENGINE_OPEN_PATHS
from common.http.app import create_app
from router.app import OPEN_PATHS as ROUTER_OPEN_PATHS
from router.app import create_router_app
from router.config import RouterConfig
from tests.conftest import ServerProcess
from tests.integration.cluster import generate
from tests.integration.faults import wait_until
from tests.integration.netns import BOOTSTRAP_PORT, PORT, STARTUP_S, Host, Network, ns_server, unavailable
from tests.integration.tls_certs import Certs, make_certs, verify_as
from transfer.messages import Ping, Register, Status, encode

pytestmark = [pytest.mark.skipif(bool(why := unavailable()), reason=str(why)), pytest.mark.timeout(900)]

KEY, SECRET, DOMAIN = "ck-5e1f0a", "cs-77b2d9", "tandem.test"
ENGINE = ("--page-size", "16", "--chunked-prefill-size", "64", "--max-total-tokens", "8192")
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village by the sea," * 6]
NEW = 12
NAME = "tandem_kv_transfer_events_total"  # event="rejected_messages": control frames dropped


@dataclass
class KeyedCluster:
    net: Network
    certs: Certs
    names: dict[str, str]  # host -> its DNS name
    servers: dict[str, ServerProcess]  # host -> the server on it
    expected: list[list[int]]  # the monolithic server's greedy tokens for TEXTS
    prompts: list[list[int]]

    def client(self, key: str | None = KEY) -> httpx.Client:
        router = self.servers["router"]
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=router.url, headers=headers, verify=router.verify, timeout=300)

    def host_of(self, address_or_name: str) -> Host:
        return next(h for h in self.net.hosts.values() if address_or_name in (h.address, self.names[h.name]))


def start_servers(net: Network, certs: Certs, names: dict[str, str]) -> dict[str, ServerProcess]:
    hosts = net.hosts
    tls = ("--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key))
    keyed = ("--api-key", KEY, "--cluster-secret", SECRET, *tls, "--ssl-ca-certs", str(certs.ca))
    servers: dict[str, ServerProcess] = {}

    def start(name: str, args: list[str], port: int = PORT) -> ServerProcess:
        proc = servers[name] = ns_server(hosts[name], args, f"ns-keyed-{name}", port, tls_ca=str(certs.ca))
        proc.verify = verify_as(certs.ca, names[name])  # this process reaches it by address, not by name
        return proc

    boot = ["bootstrap", "--host", "0.0.0.0", "--port", str(BOOTSTRAP_PORT), "--cluster-secret", SECRET, *tls]
    start("bootstrap", boot, BOOTSTRAP_PORT)  # all start at once: the prefill registers once it can
    for role in ("prefill", "decode"):
        args = ["serve", "--host", "0.0.0.0", "--port", str(PORT), "--advertise-host", hosts[role].address]
        args += ["--disaggregation-mode", role, "--transfer-backend", "mooncake", *ENGINE, *keyed]
        if role == "prefill":
            args += ["--bootstrap-url", f"https://{names['bootstrap']}:{BOOTSTRAP_PORT}"]
        start(role, args)
    discovery = ["--prefill-discovery", f"{names['prefill']}:{PORT}", "--prefill-bootstrap-host", names["bootstrap"]]
    discovery += ["--prefill-bootstrap-port", str(BOOTSTRAP_PORT), "--discovery-interval-s", "0.5"]
    router = ["router", "--host", "0.0.0.0", "--port", str(PORT), *keyed[:2], *keyed[4:], *discovery]
    start("router", [*router, "--health-check-interval-s", "0.5"])
    for proc in servers.values():
        proc.wait_ready(STARTUP_S)
    return servers


def add_decode_and_wait_ready(c: KeyedCluster) -> None:
    with c.client() as client:
        r = client.post("/workers", json={"url": f"https://{c.names['decode']}:{PORT}", "role": "decode"})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while client.get("/readiness").status_code != 200:
            assert time.monotonic() < deadline, c.servers["router"].log_tail()
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(builtin_model_dir, tmp_path_factory, reference_servers) -> Iterator[KeyedCluster]:
    mono = reference_servers.get(*ENGINE)  # test_pd.py's
    net = Network()
    servers: dict[str, ServerProcess] = {}
    try:
        for name in ("router", "bootstrap", "prefill", "decode"):
            net.add_host(name)
        names = net.name_hosts(DOMAIN)
        certs = make_certs(tmp_path_factory.mktemp("keyed-tls"), names=tuple(names.values()))
        servers = start_servers(net, certs, names)
        tok = AutoTokenizer.from_pretrained(builtin_model_dir)
        prompts = [tok.encode(t) for t in TEXTS]
        expected = [generate(mono.url, ids, NEW)["output_ids"] for ids in prompts]
        c = KeyedCluster(net, certs, names, servers, expected, prompts)
        add_decode_and_wait_ready(c)
        yield c
    finally:
        for proc in servers.values():
            proc.stop()
        net.close()


def sse_output_ids(text: str) -> list[int]:
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return events[-1]["output_ids"]


def test_pd_across_hosts_with_keys_secret_and_tls_gives_the_monolithic_tokens(cluster):
    with cluster.client() as client:
        for ids, want in zip(cluster.prompts, cluster.expected):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}
            r = client.post("/generate", json=body)
            assert r.status_code == 200 and r.json()["output_ids"] == want, r.text
            r = client.post("/generate", json=body | {"stream": True})
            assert r.status_code == 200 and sse_output_ids(r.text) == want, r.text
        assert client.get("/health_generate").status_code == 200
        workers = {(w["url"], w["role"], w["healthy"]) for w in client.get("/workers").json()["workers"]}
    prefill = cluster.net.hosts["prefill"].address  # discovered: dialled by address, verified by name
    assert workers == {
        (f"https://{prefill}:{PORT}", "prefill", True),
        (f"https://{cluster.names['decode']}:{PORT}", "decode", True),
    }
    for role in ("prefill", "decode"):
        cluster.servers[role].wait_idle()


@dataclass(frozen=True)
class Port:
    host: str  # the host's name in the network
    port: int
    kind: str  # "router" | "engine" | "bootstrap" | "control"
    owner: str  # the server whose /metrics counts what its control port drops


def enumerate_ports(c: KeyedCluster) -> list[Port]:
    """Every HTTP and ZMQ port of the cluster, from what the processes say about themselves."""
    with c.client() as client:
        info = client.get("/get_server_info").json()
    config = info["config"]
    router = c.host_of(urlsplit(c.servers["router"].url).hostname).name
    boot = c.host_of(config["prefill_bootstrap_host"]).name
    ports = [
        Port(router, config["port"], "router", router),
        Port(boot, config["prefill_bootstrap_port"], "bootstrap", boot),
    ]
    for worker in info["prefill"] + info["decode"]:
        assert "error" not in worker, worker
        host = c.host_of(urlsplit(worker["url"]).hostname).name
        control = urlsplit(worker["role"]["control_endpoint"])
        assert c.host_of(control.hostname).name == host, worker["role"]
        ports += [Port(host, worker["config"]["port"], "engine", host), Port(host, control.port, "control", host)]
    return ports


def http_routes(kind: str) -> list[tuple[str, str]]:
    """Every (method, path) the router or an engine server answers, from the app itself: a new route is
    walked too."""
    if kind == "router":
        app = create_router_app(RouterConfig(api_key="k"))
        return sorted({(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"})
    stub = SimpleNamespace(config=ServerConfig(api_key="k"), metrics=None, role_switch=None)
    return [(m, r.path) for r in create_app(stub).routes for m in sorted(r.methods) if m != "HEAD"]


def refuses_plain_http(url: str) -> None:
    r = httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "scheme", (url, r.text)


def check_http(c: KeyedCluster, p: Port, url: str) -> int:
    verify = verify_as(c.certs.ca, c.names[p.host])
    open_paths = ROUTER_OPEN_PATHS if p.kind == "router" else ENGINE_OPEN_PATHS
    routes = http_routes(p.kind)
    assert ("POST", "/generate") in routes and ("GET", "/get_server_info") in routes
    for method, path in routes:
        r = httpx.request(method, url + path, json={}, verify=verify, timeout=30)
        want = 200 if path in open_paths else 401
        assert r.status_code == want, f"{p} {method} {path}: {r.status_code} {r.text[:200]}"
    return len(routes)


def check_bootstrap(c: KeyedCluster, url: str) -> int:
    verify = verify_as(c.certs.ca, c.names["bootstrap"])
    calls = 0
    for method in ("PUT", "GET", "DELETE"):
        path = "/route" if method == "PUT" else "/route?engine_rank=0&target_dp_group=0"
        for headers in ({}, {SIGNATURE_HEADER: sign("not-the-secret", method, path, b"{}")}):
            r = httpx.request(method, url + path, content=b"{}", headers=headers, verify=verify, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["param"] == "signature", r.text
            calls += 1
    return calls


def check_control(c: KeyedCluster, p: Port) -> int:
    owner = c.servers[p.owner]
    fake = Register("intruder", "tcp://10.0.0.1:1", [b"10.0.0.1:1"], [4096], [64], 8, 16, 4096, 188, 2)
    frames = [encode(fake, None), encode(fake, "not-the-secret"), encode(Status(1, True, ""), None)]
    frames.append(encode(Ping("intruder"), "not-the-secret"))

    def dropped() -> float:
        text = httpx.get(owner.url + "/metrics", verify=owner.verify, timeout=10).text
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        return sum(s.value for s in samples if s.name == NAME and s.labels.get("event") == "rejected_messages")

    before = dropped()
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"tcp://{c.net.hosts[p.host].address}:{p.port}")
    for frame in frames:
        sock.send(frame)
    sock.close()
    wait_until(lambda: dropped() - before == len(frames), 10, f"{p} to drop and count {len(frames)} frames")
    return len(frames)


def test_every_http_and_zmq_port_refuses_unauthenticated_calls(cluster):
    ports = enumerate_ports(cluster)
    assert sorted((p.host, p.kind) for p in ports) == [
        ("bootstrap", "bootstrap"),
        ("decode", "control"),
        ("decode", "engine"),
        ("prefill", "control"),
        ("prefill", "engine"),
        ("router", "router"),
    ]
    rows = []
    for name, host in cluster.net.hosts.items():
        named = {p.port for p in ports if p.host == name}
        listening = cluster.net.listening(host)
        assert named <= listening, (name, named, listening)
        others = listening - named  # the transfer engine's data ports: only where an engine runs
        assert not others or name in ("prefill", "decode"), (name, others)
        rows.append(f"{name:9} {host.address:12} HTTP/ZMQ {sorted(named)}  transfer engine (no auth) {sorted(others)}")
    for p in ports:
        url = f"https://{cluster.net.hosts[p.host].address}:{p.port}"
        if p.kind == "control":
            calls = check_control(cluster, p)
        else:
            refuses_plain_http(url)
            calls = check_bootstrap(cluster, url) if p.kind == "bootstrap" else check_http(cluster, p, url)
        rows.append(f"  {p.host}:{p.port} {p.kind}: {calls} unauthenticated calls refused")
    print("\n" + "\n".join(rows))
    with cluster.client() as client:  # and the cluster serves on, exactly
        body = {"input_ids": cluster.prompts[0], "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}
        assert client.post("/generate", json=body).json()["output_ids"] == cluster.expected[0]
