"""The control plane under faults and abuse (tiny model, real processes, cluster secret on): a
standalone bootstrap server killed and restarted, garbage and forged ZMQ control messages, processes
without the secret, and which addresses the servers listen on."""

from __future__ import annotations

import signal
import time

import httpx
import msgpack
import pytest
import zmq

from bootstrap.signing import sign
from tests.conftest import ServerProcess, free_port, metric, record_fault, start_server
from tests.integration.cluster import generate, start_router
from tests.integration.faults import pages_held, wait_until
from tests.integration.tiny_model import random_prompts
from transfer.messages import Abort, Ping, Register, RoomRequest, Status, encode

SECRET = "test-cluster-secret"
ENGINE = ("--page-size", "4", "--chunked-prefill-size", "32")  # what the output depends on
FLAGS = (*ENGINE, "--heartbeat-interval-s", "0.5", "--transfer-timeout-s", "5")
PROMPTS = random_prompts(3, 8, 40, seed=7)


class Cluster:
    def __init__(self, model: str):
        self.boot_port = free_port()
        self.bootstrap = ServerProcess(
            ["bootstrap", "--port", str(self.boot_port), "--cluster-secret", SECRET], self.boot_port, name="bootstrap"
        )
        common = ("--model", model, "--transfer-backend", "mooncake", "--cluster-secret", SECRET, *FLAGS)
        self.prefill = start_server(
            "--disaggregation-mode",
            "prefill",
            "--bootstrap-url",
            f"http://127.0.0.1:{self.boot_port}",
            "--bootstrap-port",
            str(self.boot_port),
            *common,
            name="cp-prefill",
        )
        self.decode = start_server("--disaggregation-mode", "decode", *common, name="cp-decode")
        for node in (self.bootstrap, self.prefill, self.decode):
            node.wait_ready()
        self.router = start_router([(self.prefill, self.boot_port)], [self.decode], "--health-check-interval-s", "0.5")

    @property
    def nodes(self) -> list[ServerProcess]:
        return [self.prefill, self.decode]

    def stop(self) -> None:
        for p in (self.router, self.prefill, self.decode, self.bootstrap):
            p.stop()


@pytest.fixture(scope="module")
def expected(tiny_model_dir, reference_servers) -> list[list[int]]:
    mono = reference_servers.get("--model", str(tiny_model_dir), *ENGINE)  # test_soak.py's
    return [generate(mono.url, p, 8)["output_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    c = Cluster(str(tiny_model_dir))
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    for node in cluster.nodes:
        node.wait_idle()


def test_bootstrap_killed_and_restarted(cluster, expected):
    assert generate(cluster.router.url, PROMPTS[0], 8)["output_ids"] == expected[0]
    cluster.bootstrap.signal(signal.SIGKILL)
    time.sleep(2.1)  # past the decode's 2 s cache of bootstrap lookups, so the next request must ask
    t0 = time.monotonic()
    r = httpx.post(
        cluster.router.url + "/generate",
        json={"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 8}},
        timeout=60,
    )
    took = time.monotonic() - t0
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert f"bootstrap server http://127.0.0.1:{cluster.boot_port} unreachable" in message
    assert took < 5
    for node in cluster.nodes:
        wait_until(lambda: pages_held(node) == 0, 20, f"{node.name} to free its pages")
    t_restart = time.monotonic()
    cluster.bootstrap.restart().wait_ready()

    def served() -> bool:
        r = httpx.post(
            cluster.router.url + "/generate",
            json={"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
            timeout=60,
        )
        return r.status_code == 200 and r.json()["output_ids"] == expected[1]

    recovery = wait_until(served, 30, "requests to succeed after the bootstrap restart", interval=0.2)
    record_fault("bootstrap SIGKILL (restarted)", f"HTTP 502: {message[:60]}", took, 0, time.monotonic() - t_restart)
    assert recovery < 10


def rejected(node: ServerProcess) -> float:
    return metric(node.url, "tandem_kv_transfer_events_total", event="rejected_messages")


def push(endpoint: str, frames: list[bytes]) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    for f in frames:
        sock.send(f)
    sock.close()


def test_garbage_and_forged_control_messages_are_rejected_counted_and_harmless(cluster, expected):
    prefill_ep = cluster.prefill.info()["role"]["control_endpoint"]
    decode_ep = cluster.decode.info()["role"]["control_endpoint"]
    before = {n.name: rejected(n) for n in cluster.nodes}
    fake = Register("intruder", "tcp://127.0.0.1:1", [b"127.0.0.1:1"], [4096], [64], 8, 4, 4096, 188, 2)
    garbage = [
        b"",
        b"\x00" * 7,
        b"\xff\xfe garbage",
        encode(Status(1, True, ""), SECRET)[:-5],
        msgpack.packb({"type": "status", "room_id": 1, "ok": True, "reason": ""}),
    ]
    to_decode = garbage + [
        encode(Status(12345, True, ""), None),  # unsigned
        encode(Status(12345, True, ""), "wrong-secret"),
        encode(Status(12345, True, ""), SECRET),  # signed, but no such room
        encode(Ping("intruder"), SECRET),  # decode does not take pings
    ]
    to_prefill = garbage + [
        encode(fake, "wrong-secret"),  # an unknown process trying to register
        encode(RoomRequest(5, "intruder", [1], 0), SECRET),  # a request from a decode that never registered
        encode(Abort(5, "intruder", "x"), SECRET),
        encode(Register("intruder", "tcp://127.0.0.1:1", [b"x"], [0], [64], 8, 4, 1, 1, 1), SECRET),  # null pointers
        encode(fake, SECRET),  # a well-formed registration (a buggy decode that knows the secret) ...
        encode(RoomRequest(6, "intruder", [9, 1], 0), SECRET),  # ... asking for pages outside its own pool
        encode(RoomRequest(7, "intruder", [1], 5), SECRET),  # ... and an aux slot outside it
    ]
    push(decode_ep, to_decode)
    push(prefill_ep, to_prefill)
    wait_until(
        lambda: rejected(cluster.decode) - before["cp-decode"] == len(to_decode),
        10,
        "decode to count every bad message",
    )
    wait_until(
        lambda: rejected(cluster.prefill) - before["cp-prefill"] == len(to_prefill) - 1,
        10,
        "prefill to count every bad message",
    )
    for node in cluster.nodes:
        assert httpx.get(node.url + "/health", timeout=5).status_code == 200
    for ids, want in zip(PROMPTS, expected):
        assert generate(cluster.router.url, ids, 8)["output_ids"] == want


def test_a_decode_without_the_cluster_secret_cannot_pair(cluster, tiny_model_dir):
    r = httpx.put(f"http://127.0.0.1:{cluster.boot_port}/route", json={"role": "Prefill"}, timeout=5)
    assert r.status_code == 401 and r.json()["error"]["param"] == "signature"
    r = httpx.get(
        f"http://127.0.0.1:{cluster.boot_port}/route",
        params={"engine_rank": 0, "target_dp_group": 0},
        headers={"X-Tandem-Signature": sign("guess", "GET", "/route?engine_rank=0&target_dp_group=0")},
        timeout=5,
    )
    assert r.status_code == 401 and "does not match" in r.json()["error"]["message"]
    stranger = start_server(
        "--disaggregation-mode",
        "decode",
        "--model",
        str(tiny_model_dir),
        "--transfer-backend",
        "mooncake",
        *FLAGS,
        name="cp-stranger",
    ).wait_ready()
    router = start_router([(cluster.prefill, cluster.boot_port)], [stranger], name="cp-router-stranger")
    try:
        t0 = time.monotonic()
        r = httpx.post(
            router.url + "/generate",
            json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}},
            timeout=60,
        )
        assert r.status_code == 502, r.text
        assert "cluster secret" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5
        stranger.wait_idle()
    finally:
        router.stop()
        stranger.stop()


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket in LISTEN state on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(addr)
    return found


def test_servers_listen_on_loopback_unless_told_otherwise(cluster):
    loopback = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
    for node in cluster.nodes:
        control_port = int(node.info()["role"]["control_endpoint"].rsplit(":", 1)[1])
        assert listening_addresses(node.port) == {loopback}, node.name
        assert listening_addresses(control_port) == {loopback}, node.name
    assert listening_addresses(cluster.boot_port) == {loopback}
    assert listening_addresses(cluster.router.port) == {loopback}
