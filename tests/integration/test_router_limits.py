"""The router's limits: overload (429), a slow body, fields the router reads with the wrong JSON type,
oversized bodies (413) and the API key. Real processes, real HTTP; every node ends with no KV page held
(the workers: tests/integration/router_nodes.py).
"""
from __future__ import annotations

import json
import socket
import time
from contextlib import closing

import httpx
import pytest

from tests.conftest import metric
from tests.integration.faults import wait_until
from tests.integration.router_nodes import (  # noqa: F401  (fixtures)
    LONG_RUN, PROMPT, gen_body, generate, idle_after, nodes, reference, routers, sse_data,
)


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


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", {"prompt": PROMPT, "echo": None, "logprobs": None}),
                                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": None})])
def test_openai_booleans_may_be_null_as_in_openais_api(nodes, routers, path, body):
    """null for stream, echo and logprobs is what OpenAI's API takes for "not set": the same answer as without them."""
    router = routers([nodes.decode])
    base = {"max_tokens": 4, "temperature": 0}
    plain = httpx.post(router.url + path, json=base | {k: v for k, v in body.items() if v is not None}, timeout=60)
    nulls = httpx.post(router.url + path, json=base | body | {"stream": None}, timeout=60)
    assert (plain.status_code, nulls.status_code) == (200, 200), nulls.text
    assert nulls.json()["choices"] == plain.json()["choices"]
