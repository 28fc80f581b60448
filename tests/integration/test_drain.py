"""Graceful stop on SIGTERM with real processes: a server (and the router) refuses new work with 503 +
Retry-After, answers its health path with 503, lets the requests in flight finish (or fails them at
the drain timeout) and exits with code 0; a router takes a draining worker out without cutting it."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.conftest import start_server
from tests.integration.cluster import start_cluster
from tests.integration.faults import wait_until

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


class Stream(threading.Thread):
    """A streamed /generate running beside the test: its SSE events, and its final status."""

    def __init__(self, url: str, max_new_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_new_tokens = url, max_new_tokens
        self.events: list[dict] = []
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        body = {
            "input_ids": PROMPT,
            "stream": True,
            "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0, "ignore_eos": True},
        }
        with httpx.stream("POST", self.url + "/generate", json=body, timeout=300) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.events.append(json.loads(line.removeprefix("data: ")))

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        wait_until(
            lambda: self.events and len(self.events[-1].get("output_ids", [])) >= n, timeout, f"{n} streamed tokens"
        )

    def finished(self, timeout: float = 180) -> list[dict]:
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        return self.events


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == "1" and response.headers["X-Tandem-Draining"] == "1"
    assert response.json()["error"]["type"] == "unavailable_error"


@pytest.fixture(scope="module")
def single_servers(builtin_model_dir):
    """The two single servers the drills stop, started at once: a drain with time to finish, and one of 1 s."""
    finish = start_server("--drain-timeout-s", "120", name="drain-finish")
    timeout = start_server("--drain-timeout-s", "1", name="drain-timeout")
    yield {"finish": finish, "timeout": timeout}
    finish.stop()
    timeout.stop()


def test_a_server_finishes_what_runs_refuses_the_rest_and_exits_0(single_servers):
    server = single_servers["finish"].wait_ready()
    try:
        stream = Stream(server.url, 100)
        stream.wait_tokens(5)
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 503, 10, "/health answering 503")
        assert_refused(httpx.get(server.url + "/health", timeout=5))
        assert_refused(httpx.post(server.url + "/generate", json={"input_ids": PROMPT}, timeout=5))
        assert_refused(httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"}, timeout=5))
        assert httpx.get(server.url + "/metrics", timeout=5).status_code == 200  # observability stays up
        last = stream.finished()[-1]
        assert stream.status == 200 and len(last["output_ids"]) == 100
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_at_the_drain_timeout_requests_in_flight_fail_with_503_and_the_server_exits_0(single_servers):
    server = single_servers["timeout"].wait_ready()
    try:
        stream = Stream(server.url, 6000)
        stream.wait_tokens(3)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        took = time.monotonic() - t0
        error = stream.finished()[-1]["error"]
        assert error["code"] == 503 and "drain timeout 1 s" in error["message"], error
        assert took < 8, f"exited {took:.1f} s after SIGTERM with a 1 s drain timeout"
    finally:
        server.stop()


def test_a_router_keeps_streaming_through_a_draining_decode_then_drains_itself(builtin_model_dir):
    cluster = start_cluster(flags=("--drain-timeout-s", "120"), router_flags=("--drain-timeout-s", "120"))
    try:
        decode = cluster.decodes[0]
        stream = Stream(cluster.url, 120)
        stream.wait_tokens(5)
        decode.proc.send_signal(signal.SIGTERM)
        workers = lambda: httpx.get(cluster.url + "/workers", timeout=5).json()["workers"]  # noqa: E731
        wait_until(
            lambda: not [w for w in workers() if w["role"] == "decode"][0]["healthy"], 10, "the decode out of rotation"
        )
        refused = httpx.post(cluster.url + "/generate", json={"input_ids": PROMPT}, timeout=30)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
        last = stream.finished()[-1]  # the router did not cut it: the decode finished it while draining
        assert "error" not in last, last
        assert len(last["output_ids"]) == 120 and last["meta_info"]["finish_reason"]["type"] == "length"
        assert decode.proc.wait(30) == 0

        decode.restart().wait_ready()
        cluster.router.wait_ready(30)  # /readiness: a healthy pair again
        stream = Stream(cluster.url, 120)
        stream.wait_tokens(5)
        cluster.router.proc.send_signal(signal.SIGTERM)
        wait_until(
            lambda: httpx.get(cluster.url + "/readiness", timeout=5).status_code == 503, 10, "/readiness answering 503"
        )
        assert_refused(httpx.get(cluster.url + "/readiness", timeout=5))
        assert_refused(httpx.post(cluster.url + "/v1/chat/completions", json={"messages": []}, timeout=5))
        assert httpx.get(cluster.url + "/health", timeout=5).status_code == 200  # alive: no kubelet restart
        assert len(stream.finished()[-1]["output_ids"]) == 120
        assert cluster.router.proc.wait(30) == 0
    finally:
        cluster.stop()
