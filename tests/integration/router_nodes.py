"""The workers the router tests share, their fixtures and helpers: `prefill` with a context of 512 tokens,
`decode` with the model's, and `decode_short` with 256, so a 600-token prompt fails on the prefill half
only and a 300-token prompt on the decode half only; `decode_short` also closes a connection without a
request head after HEAD_S (`--head-timeout-s`, default 30 s), so the deadline test waits seconds, not 30. Each test starts its own router (under a second)
with the flags it needs; every surviving node ends each test with no KV page held (`idle_after`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, free_port, metric, start_server
from tests.integration.cluster import start_router

FLAGS = ("--transfer-backend", "mooncake", "--page-size", "16", "--chunked-prefill-size", "64")
PROMPT = list(range(500, 520))
OVER_PREFILL = list(range(1000, 1600))  # 600 tokens: more than the prefill's context
OVER_DECODE_SHORT = list(range(1000, 1300))  # 300 tokens: more than decode_short's context
LONG_RUN = 400  # new tokens: a request that runs for many seconds on this machine
NO_HEALTH_CHECKS = ("--health-check-interval-s", "600")  # only the check at start-up
HEAD_S = 4.0  # decode_short's --head-timeout-s
FAST_HEALTH = ("--health-check-interval-s", "0.3", "--health-check-timeout-s", "0.5", "--health-failure-threshold", "2")


@dataclass
class Nodes:
    prefill: ServerProcess
    decode: ServerProcess
    decode_short: ServerProcess
    bootstrap_port: int

    def all(self) -> list[ServerProcess]:
        return [self.prefill, self.decode, self.decode_short]


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    boot = free_port()
    servers: list[ServerProcess] = []
    try:
        servers.append(
            start_server(
                "--disaggregation-mode",
                "prefill",
                "--bootstrap-port",
                str(boot),
                *FLAGS,
                "--context-length",
                "512",
                name="rf-prefill",
            )
        )
        servers.append(start_server("--disaggregation-mode", "decode", *FLAGS, name="rf-decode"))
        servers.append(
            start_server(
                "--disaggregation-mode",
                "decode",
                *FLAGS,
                "--context-length",
                "256",
                "--head-timeout-s",
                str(HEAD_S),
                name="rf-decode-short",
            )
        )
        for s in servers:
            s.wait_ready()
        yield Nodes(*servers, bootstrap_port=int(servers[0].arg("--bootstrap-port")))  # where it listens
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def routers(nodes) -> Iterator[Callable[..., ServerProcess]]:
    """Starts routers over the prefill and the given decodes for one test, and stops them after it."""
    started: list[ServerProcess] = []

    def start(decodes: list[ServerProcess], *flags: str) -> ServerProcess:
        started.append(router_over(nodes, decodes, *flags, name=f"rf-router{len(started)}"))
        return started[-1]

    yield start
    for r in started:
        r.stop()


@pytest.fixture(autouse=True)
def idle_after(nodes) -> Iterator[None]:
    yield
    for node in nodes.all():
        if node.proc.poll() is None:
            node.wait_idle()


@pytest.fixture(scope="module")
def reference(nodes) -> list[int]:
    """Greedy output of PROMPT through a healthy pair, before any fault."""
    router = router_over(nodes, [nodes.decode], name="rf-reference")
    try:
        return generate(router, PROMPT)["output_ids"]
    finally:
        router.stop()


# -- helpers ------------------------------------------------------------------------------------


def router_over(nodes: Nodes, decodes: list[ServerProcess], *flags: str, name: str) -> ServerProcess:
    return start_router([(nodes.prefill, nodes.bootstrap_port)], decodes, *flags, policy="round_robin", name=name)


def gen_body(ids: list[int], max_new: int = 8, stream: bool = False) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}, "stream": stream}


def generate(router: ServerProcess, ids: list[int], max_new: int = 8) -> dict:
    r = httpx.post(router.url + "/generate", json=gen_body(ids, max_new), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def aborted(node: ServerProcess) -> float:
    return metric(node.url, "tandem_requests_finished_total", reason="abort")


def served(node: ServerProcess) -> float:
    return metric(node.url, "tandem_requests_total", endpoint="/generate", status="200")


def cancelled(router: ServerProcess, cause: str) -> float:
    return metric(router.url, "tandem_router_cancelled_requests_total", cause=cause)


def worker(router: ServerProcess, node: ServerProcess) -> dict:
    workers = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    return next(w for w in workers if w["url"] == node.url)


def sse_data(lines: Iterator[str]) -> Iterator[Any]:
    """The `data:` payloads of an SSE stream, parsed; "[DONE]" as is."""
    for line in lines:
        if line.startswith("data: "):
            yield "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])


def context_error(tokens: int, context: int, param: str) -> dict:
    return {
        "error": {
            "message": f"{param} has {tokens} tokens; this server's context length is {context}",
            "type": "invalid_request_error",
            "code": 400,
            "param": param,
        }
    }
