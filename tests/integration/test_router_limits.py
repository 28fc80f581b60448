"""The router's limits: overload (429), a slow body, fields the router reads with the wrong JSON type,
oversized bodies (413) and the API key; the HTTP edge it shares with the engine servers (the request head's
deadline, compressed bodies, a client leaving mid-body); its cluster status endpoints (/get_server_info,
/health_generate). Real processes, real HTTP; every node ends with no KV page held (the workers:
tests/integration/router_nodes.py).
"""

from __future__ import annotations

import gzip
import json
import socket
import time
from contextlib import ExitStack, closing

import httpx
import pytest

from tests.conftest import ServerProcess, free_port, metric
from tests.integration.faults import wait_until
from tests.integration.router_nodes import (  # noqa: F401  (fixtures)
    HEAD_S,
    LONG_RUN,
    PROMPT,
    gen_body,
    generate,
    idle_after,
    nodes,
    reference,
    routers,
    served,
    sse_data,
)


def test_requests_beyond_the_concurrency_limit_get_429(nodes, routers, monkeypatch, reference):
    monkeypatch.setenv("TANDEM_ROUTER_MAX_CONCURRENT_REQUESTS", "1")  # the environment variable, not the flag
    router = routers([nodes.decode])
    with httpx.stream("POST", router.url + "/generate", json=gen_body(PROMPT, LONG_RUN, stream=True), timeout=60) as r:
        events = sse_data(r.iter_lines())  # kept: dropping the iterator would close the stream
        assert next(events)["output_ids"] == reference[:1]
        refused = httpx.post(router.url + "/generate", json=gen_body(PROMPT), timeout=10)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json() == {
        "error": {
            "message": "the router has 1 requests in flight, its limit; retry later",
            "type": "overloaded_error",
            "code": 429,
            "param": None,
        }
    }
    wait_until(
        lambda: metric(router.url, "tandem_router_in_flight_requests") == 0, 10, "the stream's slot to be given back"
    )
    assert generate(router, PROMPT)["output_ids"] == reference


def test_a_client_sending_its_body_slowly_holds_no_admission_slot(nodes, routers, monkeypatch, reference):
    """The body is read before the request is admitted: with a limit of 1, a client that sent its headers
    and half its body does not make the next request a 429."""
    monkeypatch.setenv("TANDEM_ROUTER_MAX_CONCURRENT_REQUESTS", "1")
    router = routers([nodes.decode])
    with closing(socket.create_connection(("127.0.0.1", router.port), timeout=10)) as slow:
        slow.sendall(b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"input_ids": [1,')
        time.sleep(0.2)
        assert generate(router, PROMPT)["output_ids"] == reference


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/generate", "stream", "false"),
        ("/generate", "return_logprob", "yes"),
        ("/generate", "logprob_start_len", "0"),
        ("/v1/completions", "echo", 1),
        ("/v1/completions", "stream", 0),
    ],
)
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
    declared = httpx.post(
        router.url + "/generate", content=body, headers={"content-type": "application/json"}, timeout=10
    )
    assert declared.status_code == 413
    assert declared.json()["error"] == {
        "message": f"request body of {len(body)} bytes exceeds the limit of 1024",
        "type": "invalid_request_error",
        "code": 413,
        "param": "body",
    }
    chunked = httpx.post(router.url + "/generate", content=iter([body[:600], body[600:]]), timeout=10)
    assert "content-length" not in chunked.request.headers and chunked.request.headers["transfer-encoding"] == "chunked"
    assert chunked.status_code == 413
    assert chunked.json()["error"] == {
        "message": "request body exceeds the limit of 1024 bytes",
        "type": "invalid_request_error",
        "code": 413,
        "param": "body",
    }
    assert metric(router.url, "tandem_router_requests_total", endpoint="/generate", status="413") == 2


def test_api_key_is_required_except_on_open_paths(nodes, routers, reference):
    router = routers([nodes.decode], "--api-key", "sesame")
    r = httpx.post(router.url + "/generate", json=gen_body(PROMPT), timeout=10)
    assert r.status_code == 401 and r.json()["error"]["param"] == "authorization"
    assert httpx.get(router.url + "/workers", timeout=10).status_code == 401
    assert httpx.get(router.url + "/metrics", timeout=10).status_code == 200
    ok = httpx.post(
        router.url + "/generate", json=gen_body(PROMPT), headers={"authorization": "Bearer sesame"}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["output_ids"] == reference


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT, "echo": None, "logprobs": None}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": None}),
    ],
)
def test_openai_booleans_may_be_null_as_in_openais_api(nodes, routers, path, body):
    """null for stream, echo and logprobs is what OpenAI's API takes for "not set": the same answer as without them."""
    router = routers([nodes.decode])
    base = {"max_tokens": 4, "temperature": 0}
    plain = httpx.post(router.url + path, json=base | {k: v for k, v in body.items() if v is not None}, timeout=60)
    nulls = httpx.post(router.url + path, json=base | body | {"stream": None}, timeout=60)
    assert (plain.status_code, nulls.status_code) == (200, 200), nulls.text
    assert nulls.json()["choices"] == plain.json()["choices"]


# -- the HTTP edge: the router and an engine server alike ------------------------------------------

PARTIAL_HEAD = b"POST /generate HTTP/1.1\r\nHost: x\r\n"  # never the blank line that ends a head
ENCODING_415 = {
    "error": {
        "message": "Content-Encoding 'gzip' is not supported: send the request body uncompressed "
        "(no Content-Encoding header, or identity)",
        "type": "invalid_request_error",
        "code": 415,
        "param": "content-encoding",
    }
}


def log_size(node: ServerProcess) -> int:
    return node.log_path.stat().st_size


def log_since(node: ServerProcess, offset: int) -> str:
    with open(node.log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def idle_connections(node: ServerProcess) -> list[tuple[str, socket.socket, float]]:
    """Three connections waiting for a complete request head, each with the time its wait began: one that
    sent nothing, one that sent half a head, and one that sent half a head after a first answer."""
    silent = socket.create_connection(("127.0.0.1", node.port), timeout=60)
    silent_since = time.monotonic()
    partial = socket.create_connection(("127.0.0.1", node.port), timeout=60)
    partial_since = time.monotonic()
    partial.sendall(PARTIAL_HEAD)
    kept = socket.create_connection(("127.0.0.1", node.port), timeout=60)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        head += kept.recv(4096)
    assert head.startswith(b"HTTP/1.1 200") and b"\r\ncontent-length: 0\r\n" in head.lower(), head
    kept_since = time.monotonic()
    kept.sendall(PARTIAL_HEAD)
    return [
        ("silent", silent, silent_since),
        ("partial head", partial, partial_since),
        ("partial head after an answer", kept, kept_since),
    ]


def seconds_until_closed(sock: socket.socket, since: float) -> float:
    """The server closes without answering: recv gives b"" (never later than the deadline + 10 s)."""
    sock.settimeout(max(0.1, since + HEAD_S + 10 - time.monotonic()))
    assert sock.recv(4096) == b""
    return time.monotonic() - since


def test_connections_without_a_complete_request_head_are_closed_at_the_deadline(nodes, routers, reference):
    """On the router (aiohttp) and on an engine server (uvicorn), both at --head-timeout-s HEAD_S (the default,
    30 s, is ARRIVAL_TIMEOUT_S: tests/unit/test_head_deadline.py): HEAD_S from the connection's start, or from
    its previous answer, for a whole request head; others are served meanwhile."""
    router = routers([nodes.decode_short], "--head-timeout-s", str(HEAD_S))
    with ExitStack() as stack:
        waiting = {node.name: idle_connections(node) for node in (router, nodes.decode_short)}
        for conns in waiting.values():
            for _, sock, _ in conns:
                stack.enter_context(closing(sock))
        assert generate(router, PROMPT)["output_ids"] == reference
        assert httpx.get(nodes.decode_short.url + "/health", timeout=10).status_code == 200
        closed = {
            (name, what): seconds_until_closed(sock, since)
            for name, conns in waiting.items()
            for what, sock, since in conns
        }
    assert all(HEAD_S - 0.5 <= s <= HEAD_S + 5 for s in closed.values()), closed
    assert generate(router, PROMPT)["output_ids"] == reference


@pytest.mark.parametrize("corrupt", [False, True], ids=["gzip", "corrupt-gzip"])
def test_a_compressed_body_is_a_415_json_error_on_the_router_and_the_servers(nodes, routers, corrupt):
    router = routers([nodes.decode])
    body = json.dumps(gen_body(PROMPT)).encode()
    data = body if corrupt else gzip.compress(body)
    offsets = {node.name: log_size(node) for node in (router, nodes.decode)}
    rejected = metric(nodes.decode.url, "tandem_rejected_inputs_total", where="http")
    for node in (router, nodes.decode):
        r = httpx.post(
            node.url + "/generate",
            content=data,
            timeout=30,
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
        assert (r.status_code, r.json()) == (415, ENCODING_415), (node.name, r.text)
    assert metric(router.url, "tandem_router_requests_total", endpoint="/generate", status="415") == 1
    assert metric(nodes.decode.url, "tandem_rejected_inputs_total", where="http") == rejected + 1
    for node in (router, nodes.decode):
        assert "Traceback" not in log_since(node, offsets[node.name])


def test_a_client_leaving_mid_body_is_a_quiet_499_on_a_server(nodes):
    """Content-Length 1000, 52 bytes sent, then gone: one INFO line, no traceback, the server answers on."""
    server = nodes.decode
    offset = log_size(server)
    left = metric(server.url, "tandem_requests_total", endpoint="/generate", status="499")
    with closing(socket.create_connection(("127.0.0.1", server.port), timeout=10)) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
            b'{"text":"Hi","sampling_params":{"max_new_tokens":2}}'
        )
    wait_until(
        lambda: metric(server.url, "tandem_requests_total", endpoint="/generate", status="499") == left + 1,
        10,
        "the request to be counted as 499",
    )
    new_lines = log_since(server, offset).splitlines()
    assert len(new_lines) == 1 and " INFO tandem.http: POST /generate -> 499 " in new_lines[0], new_lines
    assert server.info()["kv_pages"]["in_use"] == 0


# -- the router's cluster status endpoints --------------------------------------------------------


def test_get_server_info_gives_the_router_config_and_each_workers_answer_by_role(nodes, routers):
    dead = f"http://127.0.0.1:{free_port()}"
    router = routers([nodes.decode], "--decode", dead, "--api-key", "sesame")
    r = httpx.get(router.url + "/get_server_info", headers={"authorization": "Bearer sesame"}, timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert (info["role"], info["config"]["decode"], "api_key" in info["config"]) == (
        "router",
        [nodes.decode.url, dead],
        False,
    )
    assert [(p["url"], p["config"]["disaggregation_mode"]) for p in info["prefill"]] == [(nodes.prefill.url, "prefill")]
    alive, gone = info["decode"]
    assert (alive["url"], alive["config"]["disaggregation_mode"], alive["kv_pages"]) == (
        nodes.decode.url,
        "decode",
        nodes.decode.info()["kv_pages"],
    )
    assert set(gone) == {"url", "error"} and gone["url"] == dead
    assert gone["error"].startswith("GET /get_server_info failed: ClientConnectorError"), gone["error"]


def test_health_generate_runs_one_token_through_a_prefill_and_a_decode(nodes, routers):
    router = routers([nodes.decode])
    before = [served(nodes.prefill), served(nodes.decode)]
    r = httpx.get(router.url + "/health_generate", timeout=60)
    assert (r.status_code, r.content) == (200, b"")
    assert [served(nodes.prefill), served(nodes.decode)] == [before[0] + 1, before[1] + 1]


def test_health_generate_is_503_naming_the_cause_without_a_pair(nodes, routers):
    router = routers([nodes.decode])
    assert (
        httpx.request("DELETE", router.url + "/workers", json={"url": nodes.decode.url}, timeout=10).status_code == 200
    )
    r = httpx.get(router.url + "/health_generate", timeout=30)
    assert r.status_code == 503
    assert r.json() == {
        "error": {
            "message": "a 1-token generation through a prefill and decode pair failed with HTTP 503: "
            "no healthy prefill and decode worker pair is available; retry later",
            "type": "unhealthy",
            "code": 503,
            "param": None,
        }
    }
