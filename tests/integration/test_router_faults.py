"""The router survives faults: a failing half cancels the other, a dead worker ends its requests, a
refusing worker is retried around, clients that leave cancel both halves, and overload and oversized
bodies are refused. Real processes, real HTTP; every surviving node ends with no KV page held.

Workers shared by the module: `prefill` with a context of 512 tokens, `decode` with the model's, and
`decode_short` with 256, so a 600-token prompt fails on the prefill half only and a 300-token prompt
on the decode half only. Each test starts its own router (under a second) with the flags it needs.
"""
from __future__ import annotations

import json
import signal
import socket
import time
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import httpx
import pytest

from tests.conftest import ServerProcess, free_port, metric, record_fault, start_server
from tests.integration.cluster import start_router
from tests.integration.faults import RawClient, wait_until

FLAGS = ("--transfer-backend", "mooncake", "--page-size", "16", "--chunked-prefill-size", "64")
PROMPT = list(range(500, 520))
OVER_PREFILL = list(range(1000, 1600))  # 600 tokens: more than the prefill's context
OVER_DECODE_SHORT = list(range(1000, 1300))  # 300 tokens: more than decode_short's context
LONG_RUN = 400  # new tokens: a request that runs for many seconds on this machine
NO_HEALTH_CHECKS = ("--health-check-interval-s", "600")  # only the check at start-up
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
        servers.append(start_server("--disagg-mode", "prefill", "--bootstrap-port", str(boot), *FLAGS, "--context-length", "512", name="rf-prefill"))
        servers.append(start_server("--disagg-mode", "decode", *FLAGS, name="rf-decode"))
        servers.append(start_server("--disagg-mode", "decode", *FLAGS, "--context-length", "256", name="rf-decode-short"))
        for s in servers:
            s.wait_ready()
        yield Nodes(*servers, bootstrap_port=boot)
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
    return {"error": {"message": f"{param} has {tokens} tokens; this server's context length is {context}",
                      "type": "invalid_request_error", "code": 400, "param": param}}


# -- a failing half cancels the other ------------------------------------------------------------

def test_prefill_error_reaches_the_client_at_once_and_the_decode_half_is_aborted(nodes, routers):
    router = routers([nodes.decode])
    start = time.monotonic()
    r = httpx.post(router.url + "/generate", json=gen_body(OVER_PREFILL), timeout=60)
    took = time.monotonic() - start
    assert r.status_code == 400 and r.json() == context_error(600, 512, "input_ids")
    assert cancelled(router, "prefill_failed") == 1
    start = time.monotonic()
    nodes.decode.wait_idle()  # it had reserved KV for the prompt; closing its connection aborted it
    record_fault("prefill answers an error, decode half waiting for KV", "HTTP 400: the prefill's own error", took, 0,
                 time.monotonic() - start)


def test_prefill_error_before_any_streamed_byte_is_a_plain_http_error(nodes, routers):
    router = routers([nodes.decode])
    r = httpx.post(router.url + "/generate", json=gen_body(OVER_PREFILL, stream=True), timeout=60)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json() == context_error(600, 512, "input_ids")
    assert cancelled(router, "prefill_failed") == 1
    nodes.decode.wait_idle()


def test_decode_error_reaches_the_client_at_once_and_the_prefill_half_is_aborted(nodes, routers):
    router = routers([nodes.decode_short])
    prefill_aborts = aborted(nodes.prefill)
    start = time.monotonic()
    r = httpx.post(router.url + "/generate", json=gen_body(OVER_DECODE_SHORT), timeout=60)
    took = time.monotonic() - start
    assert r.status_code == 400 and r.json() == context_error(300, 256, "input_ids")
    assert cancelled(router, "decode_failed") == 1
    # the prefill waits for its decode to reserve memory, so it holds the request until cancelled
    aborted_after = wait_until(lambda: aborted(nodes.prefill) == prefill_aborts + 1, 5, "the prefill to abort")
    nodes.prefill.wait_idle()
    record_fault("decode answers an error, prefill half waiting for it", "HTTP 400: the decode's own error", took, 0, aborted_after)


def test_prefill_failing_mid_stream_ends_the_stream_with_its_error_event(nodes, routers):
    """A chat stream starts (the decode sends the assistant role at once) while the prefill is frozen;
    thawed, the prefill refuses the prompt, and the client's stream ends with that error, then [DONE]."""
    router = routers([nodes.decode], *NO_HEALTH_CHECKS)
    body = {"model": "default", "messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 8, "stream": True}
    nodes.prefill.signal(signal.SIGSTOP)
    try:
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = sse_data(r.iter_lines())
            assert next(events)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            nodes.prefill.signal(signal.SIGCONT)
            thawed = time.monotonic()
            rest = list(events)
        took = time.monotonic() - thawed
    finally:
        nodes.prefill.signal(signal.SIGCONT)
    assert len(rest) == 2 and rest[1] == "[DONE]"
    error = rest[0]["error"]
    assert error["code"] == 400 and error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert error["message"].endswith(" tokens; this server's context length is 512")
    assert cancelled(router, "prefill_failed") == 1
    nodes.decode.wait_idle()
    record_fault("prefill answers an error after the stream started", "SSE error event: the prefill's error", took, 0, None)


# -- the client goes away ------------------------------------------------------------------------

def test_client_leaving_a_plain_request_cancels_it(nodes, routers):
    router = routers([nodes.decode])
    decode_aborts = aborted(nodes.decode)
    with closing(RawClient(router, "/generate", gen_body(PROMPT, LONG_RUN))) as client:
        wait_until(lambda: nodes.decode.info()["num_running_reqs"] == 1, 30, "the decode to run the request")
        client.close()
        left = time.monotonic()
    wait_until(lambda: aborted(nodes.decode) == decode_aborts + 1, 10, "the decode to abort")
    took = time.monotonic() - left
    nodes.decode.wait_idle()
    record_fault("client disconnect (non-streaming)", "(gone) decode aborted", took, 0, None)
    assert cancelled(router, "client_disconnected") == 1
    assert worker(router, nodes.decode)["in_flight"] == 0 and worker(router, nodes.prefill)["in_flight"] == 0


def test_client_leaving_a_stream_cancels_it(nodes, routers):
    router = routers([nodes.decode])
    decode_aborts = aborted(nodes.decode)
    with closing(RawClient(router, "/generate", gen_body(PROMPT, LONG_RUN, stream=True))) as client:
        assert client.read_until(b"data: ").startswith(b"HTTP/1.1 200")
        client.close()
    wait_until(lambda: aborted(nodes.decode) == decode_aborts + 1, 10, "the decode to abort")
    nodes.decode.wait_idle()
    wait_until(lambda: cancelled(router, "client_disconnected") == 1, 5, "the router to count the cancellation")
    assert worker(router, nodes.decode)["in_flight"] == 0


# -- a worker declared dead ends its requests now --------------------------------------------------

def test_decode_failing_health_checks_ends_its_streams_and_serves_again_once_healthy(nodes, routers, reference):
    router = routers([nodes.decode], *FAST_HEALTH)
    try:
        with httpx.stream("POST", router.url + "/generate", json=gen_body(PROMPT, LONG_RUN, stream=True), timeout=60) as r:
            events = sse_data(r.iter_lines())
            assert next(events)["output_ids"] == reference[:1]
            nodes.decode.signal(signal.SIGSTOP)
            stopped = time.monotonic()
            rest = list(events)
        took = time.monotonic() - stopped
    finally:
        nodes.decode.signal(signal.SIGCONT)
    assert rest[-1] == "[DONE]" and all("output_ids" in e for e in rest[:-2])
    error = rest[-2]["error"]
    assert error["code"] == 502 and error["type"] == "upstream_unavailable"
    assert error["message"].startswith(f"request cancelled: decode worker {nodes.decode.url} failed health checks")
    assert cancelled(router, "worker_dead") == 1
    nodes.decode.wait_idle()
    back = wait_until(lambda: worker(router, nodes.decode)["healthy"], 10, "the decode to be healthy again")
    assert generate(router, PROMPT)["output_ids"] == reference
    record_fault("decode SIGSTOP mid-stream (1P1D, fast health checks)", f"SSE error event: {error['message'][:60]}", took, 0, back)


def test_prefill_failing_health_checks_ends_its_requests(nodes, routers, reference):
    # 3 checks of 0.5 s must fail first: the request below reaches the router long before that
    router = routers([nodes.decode], "--health-check-interval-s", "0.5", "--health-check-timeout-s", "0.5",
                     "--health-failure-threshold", "3")
    nodes.prefill.signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        with httpx.stream("POST", router.url + "/generate", json=gen_body(PROMPT, stream=True), timeout=60) as r:
            status, body = r.status_code, r.read()
        took = time.monotonic() - stopped
    finally:
        nodes.prefill.signal(signal.SIGCONT)
    # nothing had been streamed (the decode waits for the prefill's KV): a plain error status
    assert status == 502, body
    error = json.loads(body)["error"]
    assert error["type"] == "upstream_unavailable" and error["code"] == 502 and error["param"] is None
    assert error["message"].startswith(f"request cancelled: prefill worker {nodes.prefill.url} failed health checks")
    assert cancelled(router, "worker_dead") == 1
    nodes.prefill.wait_idle()
    nodes.decode.wait_idle()
    back = wait_until(lambda: worker(router, nodes.prefill)["healthy"], 10, "the prefill to be healthy again")
    assert generate(router, PROMPT)["output_ids"] == reference
    record_fault("prefill SIGSTOP before the request (1P1D)", f"HTTP 502: {error['message'][:60]}", took, 0, back)


# -- overload, oversized bodies, the API key ----------------------------------------------------------

def test_requests_beyond_the_concurrency_limit_get_429(nodes, routers, monkeypatch, reference):
    monkeypatch.setenv("TANDEM_ROUTER_MAX_CONCURRENT_REQUESTS", "1")  # the environment variable, not the flag
    router = routers([nodes.decode])
    with httpx.stream("POST", router.url + "/generate", json=gen_body(PROMPT, LONG_RUN, stream=True), timeout=60) as r:
        events = sse_data(r.iter_lines())  # kept: dropping the iterator would close the stream
        assert next(events)["output_ids"] == reference[:1]
        refused = httpx.post(router.url + "/generate", json=gen_body(PROMPT), timeout=10)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json() == {"error": {"message": "the router has 1 requests in flight, its limit; retry later",
                                        "type": "overloaded_error", "code": 429, "param": None}}
    wait_until(lambda: metric(router.url, "tandem_router_in_flight_requests") == 0, 10, "the stream's slot to be given back")
    assert generate(router, PROMPT)["output_ids"] == reference


def test_a_client_sending_its_body_slowly_holds_no_admission_slot(nodes, routers, monkeypatch, reference):
    """The body is read before the request is admitted: with a limit of 1, a client that sent its headers
    and half its body does not make the next request a 429."""
    monkeypatch.setenv("TANDEM_ROUTER_MAX_CONCURRENT_REQUESTS", "1")
    router = routers([nodes.decode])
    with closing(socket.create_connection(("127.0.0.1", router.port), timeout=10)) as slow:
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"input_ids\": [1,")
        time.sleep(0.2)
        assert generate(router, PROMPT)["output_ids"] == reference


@pytest.mark.parametrize(("path", "field", "value"), [("/generate", "stream", "false"), ("/generate", "return_logprob", "yes"),
                                                     ("/generate", "logprob_start_len", "0"), ("/v1/completions", "echo", 1),
                                                     ("/v1/completions", "stream", 0)])
def test_fields_the_router_reads_must_have_their_json_type(nodes, routers, path, field, value):
    """stream, echo, return_logprob, logprob_start_len: a value a lax parser would coerce ("false", 1) means
    one thing to the router and another to the worker, so the workers refuse it, naming the field, and the
    router passes that 400 on."""
    router = routers([nodes.decode])
    body = gen_body(PROMPT) if path == "/generate" else {"prompt": PROMPT, "max_tokens": 4}
    r = httpx.post(router.url + path, json=body | {field: value}, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, field), r.text


def test_body_over_the_limit_gets_413_with_content_length_or_chunked(nodes, routers):
    router = routers([nodes.decode], "--max-request-bytes", "1024")
    body = json.dumps(gen_body(list(range(400)))).encode()
    assert len(body) > 1024
    declared = httpx.post(router.url + "/generate", content=body, headers={"content-type": "application/json"}, timeout=10)
    assert declared.status_code == 413
    assert declared.json()["error"] == {"message": f"request body of {len(body)} bytes exceeds the limit of 1024",
                                        "type": "invalid_request_error", "code": 413, "param": "body"}
    chunked = httpx.post(router.url + "/generate", content=iter([body[:600], body[600:]]), timeout=10)
    assert "content-length" not in chunked.request.headers and chunked.request.headers["transfer-encoding"] == "chunked"
    assert chunked.status_code == 413
    assert chunked.json()["error"] == {"message": "request body exceeds the limit of 1024 bytes",
                                       "type": "invalid_request_error", "code": 413, "param": "body"}
    assert metric(router.url, "tandem_router_requests_total", endpoint="/generate", status="413") == 2


def test_api_key_is_required_except_on_open_paths(nodes, routers, reference):
    router = routers([nodes.decode], "--api-key", "sesame")
    r = httpx.post(router.url + "/generate", json=gen_body(PROMPT), timeout=10)
    assert r.status_code == 401 and r.json()["error"]["param"] == "authorization"
    assert httpx.get(router.url + "/workers", timeout=10).status_code == 401
    assert httpx.get(router.url + "/metrics", timeout=10).status_code == 200
    ok = httpx.post(router.url + "/generate", json=gen_body(PROMPT), headers={"authorization": "Bearer sesame"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["output_ids"] == reference


# -- a killed decode (these run last: one kill, one restart) -----------------------------------------

@dataclass
class KilledDecode:
    stream_events: list[Any]
    seconds_to_error: float
    stream_router: ServerProcess
    retry_router: ServerProcess
    health_router: ServerProcess


@pytest.fixture(scope="module")
def decode_killed_mid_stream(nodes) -> Iterator[KilledDecode]:
    """decode_short is SIGKILLed while it streams. Three routers knew it healthy before: one streamed
    through it, one does no more health checks (it learns from refused connections), one checks health
    fast. The module restarts the decode afterwards if no test did."""
    victim = nodes.decode_short
    routers = [router_over(nodes, [victim], *NO_HEALTH_CHECKS, name="rf-stream"),
               router_over(nodes, [victim, nodes.decode], *NO_HEALTH_CHECKS, name="rf-retry"),
               router_over(nodes, [victim, nodes.decode], *FAST_HEALTH, name="rf-health")]
    try:
        for r in routers[1:]:
            wait_until(lambda: worker(r, victim)["healthy"] and worker(r, nodes.decode)["healthy"], 10, "both decodes healthy")
        with httpx.stream("POST", routers[0].url + "/generate", json=gen_body(PROMPT, 200, stream=True), timeout=60) as resp:
            events = sse_data(resp.iter_lines())
            first = next(events)
            victim.signal(signal.SIGKILL)
            killed = time.monotonic()
            rest = list(events)
        yield KilledDecode([first, *rest], time.monotonic() - killed, *routers)
    finally:
        for r in routers:
            r.stop()
        if victim.proc.poll() is not None:
            victim.restart().wait_ready()


def test_decode_killed_mid_stream_ends_the_stream_with_an_error_naming_it(nodes, decode_killed_mid_stream, reference):
    killed = decode_killed_mid_stream
    *tokens, error, done = killed.stream_events
    assert tokens[0]["output_ids"] == reference[:1] and done == "[DONE]"
    assert error["error"]["code"] == 502 and error["error"]["type"] == "upstream_error"
    assert error["error"]["message"].startswith(f"decode worker {nodes.decode_short.url} failed mid-stream: ")
    assert worker(killed.stream_router, nodes.decode_short)["failures"] == 1
    assert cancelled(killed.stream_router, "decode_failed") == 1


def test_a_refused_connection_is_retried_on_another_decode(nodes, decode_killed_mid_stream, reference):
    router = decode_killed_mid_stream.retry_router
    served_before = served(nodes.decode)
    for _ in range(4):
        assert generate(router, PROMPT)["output_ids"] == reference
    assert served(nodes.decode) == served_before + 4
    # round robin: requests 1 and 2 first went to the dead decode; its 2nd refusal took it out of rotation
    assert metric(router.url, "tandem_router_retries_total") == 2
    assert cancelled(router, "decode_failed") == 2
    record_fault("decode SIGKILLed, router not yet aware (refused)", "HTTP 200: retried on the other decode, exact tokens", None, 0, None)
    assert worker(router, nodes.decode_short) == {"url": nodes.decode_short.url, "role": "decode", "bootstrap_port": None, "bootstrap_host": None,
                                                  "healthy": False, "failures": 2, "in_flight": 0}


def test_a_killed_decode_leaves_rotation_and_serves_again_after_restart(nodes, decode_killed_mid_stream, reference):
    router, victim = decode_killed_mid_stream.health_router, nodes.decode_short
    wait_until(lambda: not worker(router, victim)["healthy"], 10, "the router to take the killed decode out")
    served_before = served(nodes.decode)
    for _ in range(3):
        assert generate(router, PROMPT)["output_ids"] == reference
    assert served(nodes.decode) == served_before + 3
    victim.restart().wait_ready()
    wait_until(lambda: worker(router, victim)["healthy"], 10, "the restarted decode to be healthy")
    for _ in range(2):  # round robin over two healthy decodes: one each
        assert generate(router, PROMPT)["output_ids"] == reference
    assert served(victim) == 1
