"""The router survives faults: a failing half cancels the other, a dead worker ends its requests, a
refusing worker is retried around, clients that leave cancel both halves. Real processes, real HTTP;
every surviving node ends with no KV page held (the workers: tests/integration/router_nodes.py).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, metric, record_fault
from tests.integration.faults import RawClient, wait_until
from tests.integration.router_nodes import (  # noqa: F401  (fixtures)
    FAST_HEALTH,
    LONG_RUN,
    NO_HEALTH_CHECKS,
    OVER_DECODE_SHORT,
    OVER_PREFILL,
    PROMPT,
    aborted,
    cancelled,
    context_error,
    gen_body,
    generate,
    idle_after,
    nodes,
    reference,
    router_over,
    routers,
    served,
    sse_data,
    worker,
)

# -- a failing half cancels the other ------------------------------------------------------------


def test_prefill_error_reaches_the_client_at_once_and_the_decode_half_is_aborted(nodes, routers):
    router = routers([nodes.decode])
    start = time.monotonic()
    r = httpx.post(router.url + "/generate", json=gen_body(OVER_PREFILL), timeout=60)
    took = time.monotonic() - start
    assert r.status_code == 400 and r.json() == context_error(600, 512, "input_ids")
    assert cancelled(router, "client_error") == 1
    start = time.monotonic()
    nodes.decode.wait_idle()  # it had reserved KV for the prompt; closing its connection aborted it
    record_fault(
        "prefill answers an error, decode half waiting for KV",
        "HTTP 400: the prefill's own error",
        took,
        0,
        time.monotonic() - start,
    )


def test_an_unknown_model_is_the_clients_404_and_no_worker_fault(nodes, routers):
    """The router knows the workers' models (their /v1/models, router/adapters.py): it answers the 404 itself,
    before any half is dispatched, and counts no worker's fault."""
    router = routers([nodes.decode])
    r = httpx.post(router.url + "/v1/completions", json={"model": "gpt-x", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"], "gpt-x" in error["message"]) == (404, "model", True)
    assert cancelled(router, "client_error") == 0  # nothing was dispatched to cancel
    assert metric(router.url, "tandem_router_upstream_errors_total") == 0
    assert worker(router, nodes.prefill)["failures"] == worker(router, nodes.decode)["failures"] == 0


def test_prefill_error_before_any_streamed_byte_is_a_plain_http_error(nodes, routers):
    router = routers([nodes.decode])
    r = httpx.post(router.url + "/generate", json=gen_body(OVER_PREFILL, stream=True), timeout=60)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json() == context_error(600, 512, "input_ids")
    assert cancelled(router, "client_error") == 1
    nodes.decode.wait_idle()


def test_decode_error_reaches_the_client_at_once_and_the_prefill_half_is_aborted(nodes, routers):
    router = routers([nodes.decode_short])
    prefill_aborts = aborted(nodes.prefill)
    start = time.monotonic()
    r = httpx.post(router.url + "/generate", json=gen_body(OVER_DECODE_SHORT), timeout=60)
    took = time.monotonic() - start
    assert r.status_code == 400 and r.json() == context_error(300, 256, "input_ids")
    assert cancelled(router, "client_error") == 1
    # the prefill waits for its decode to reserve memory, so it holds the request until cancelled
    aborted_after = wait_until(lambda: aborted(nodes.prefill) == prefill_aborts + 1, 5, "the prefill to abort")
    nodes.prefill.wait_idle()
    record_fault(
        "decode answers an error, prefill half waiting for it",
        "HTTP 400: the decode's own error",
        took,
        0,
        aborted_after,
    )


def test_prefill_failing_mid_stream_ends_the_stream_with_its_error_event(nodes, routers):
    """A chat stream starts (the decode sends the assistant role at once) while the prefill is frozen;
    thawed, the prefill refuses the prompt, and the client's stream ends with that error, then [DONE]."""
    router = routers([nodes.decode], *NO_HEALTH_CHECKS)
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "word " * 600}],
        "max_tokens": 8,
        "stream": True,
    }
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
    assert cancelled(router, "client_error") == 1
    nodes.decode.wait_idle()
    record_fault(
        "prefill answers an error after the stream started", "SSE error event: the prefill's error", took, 0, None
    )


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
        with httpx.stream(
            "POST", router.url + "/generate", json=gen_body(PROMPT, LONG_RUN, stream=True), timeout=60
        ) as r:
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
    record_fault(
        "decode SIGSTOP mid-stream (1P1D, fast health checks)",
        f"SSE error event: {error['message'][:60]}",
        took,
        0,
        back,
    )


def test_prefill_failing_health_checks_ends_its_requests(nodes, routers, reference):
    # 3 checks of 0.5 s must fail first: the request below reaches the router long before that
    router = routers(
        [nodes.decode],
        "--health-check-interval-s",
        "0.5",
        "--health-check-timeout-s",
        "0.5",
        "--health-failure-threshold",
        "3",
    )
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
    routers = [
        router_over(nodes, [victim], *NO_HEALTH_CHECKS, name="rf-stream"),
        router_over(nodes, [victim, nodes.decode], *NO_HEALTH_CHECKS, name="rf-retry"),
        router_over(nodes, [victim, nodes.decode], *FAST_HEALTH, name="rf-health"),
    ]
    try:
        for r in routers[1:]:
            wait_until(
                lambda: worker(r, victim)["healthy"] and worker(r, nodes.decode)["healthy"], 10, "both decodes healthy"
            )
        with httpx.stream(
            "POST", routers[0].url + "/generate", json=gen_body(PROMPT, 200, stream=True), timeout=60
        ) as resp:
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
    record_fault(
        "decode SIGKILLed, router not yet aware (refused)",
        "HTTP 200: retried on the other decode, exact tokens",
        None,
        0,
        None,
    )
    assert worker(router, nodes.decode_short) == {
        "url": nodes.decode_short.url,
        "role": "decode",
        "bootstrap_port": None,
        "bootstrap_host": None,
        "healthy": False,
        "failures": 2,
        "in_flight": 0,
    }


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
