"""`tandem epp` behind a real Envoy (tests/integration/gateway.py: the extension's conformance setup) over two
monolithic servers of the built-in model that publish KV events: a request lands where the picker chose (the servers'
own request counters), the gateway's candidate subset is honoured, a client cannot pick its endpoint, a multi-turn
conversation lands on the server holding its pages (kv_aware), streaming works through Envoy, a dead server is
dropped within the health bounds, and the picker's death follows the ext_proc filter's failure mode (FailOpen:
the gateway's own pick; FailClose: no request)."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.conftest import metric, start_server
from tests.integration.gateway import Envoy, epp_address, start_epp

PAGE = 16
EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
FLAGS = ("--page-size", str(PAGE), "--chunked-prefill-size", "64", "--kv-events-config", EVENTS)
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def servers():
    started = [start_server(*FLAGS, name=f"gw-mono{i}") for i in range(2)]
    try:
        yield [s.wait_ready(300) for s in started]
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def epp(servers):
    pool = [a for s in servers for a in ("--worker", s.url)]
    p = start_epp(*pool, policy="kv_aware", extra=("--kv-load-tokens", "16"))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def envoy(servers, epp, tmp_path_factory):
    pool = [s.url.removeprefix("http://") for s in servers]
    e = Envoy(epp_address(epp), pool, [pool[1]], tmp_path_factory.mktemp("envoy")).wait_ready(60)
    yield e
    e.stop()


def served(server) -> float:
    """The /generate requests a server answered (its own counter)."""
    return metric(server.url, "tandem_requests_total", endpoint="/generate", status="200")


def in_flight(epp) -> int:
    """The requests in flight the picker counts, over its servers."""
    return sum(w["in_flight"] for w in httpx.get(epp.url + "/workers", timeout=5).json()["workers"])


def generate(url: str, ids: list[int], max_new: int = 8, headers: dict | None = None) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
    return httpx.post(url + "/generate", json=body, headers=headers, timeout=120)


def test_subset_and_placement_land_where_the_picker_chose(servers, envoy):
    """The subset listener names the second server alone: every request lands there, and its answer is the
    server's own; a client's x-gateway-destination-endpoint changes nothing."""
    ids = list(range(100, 140))
    direct = generate(servers[1].url, ids).json()["output_ids"]
    before = [served(s) for s in servers]
    for _ in range(3):
        r = generate(envoy.listener("subset"), ids, headers={"x-gateway-destination-endpoint": "127.0.0.1:1"})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == direct
    assert [served(s) - b for s, b in zip(servers, before)] == [0, 3]


def test_conversation_lands_on_the_server_holding_its_pages(servers, envoy):
    """kv_aware: a conversation's first turn placed on the second server (the subset listener), its next turns, sent
    with no subset, go back there (where the tie between two idle servers would pick the first), reusing the pages the
    turns before cached (their answers say so); greedy output equals the other server's own."""
    prompt, answers = list(range(1000, 1080)), []
    for turn, listener in enumerate(("subset", "fail_close", "fail_close")):
        before = [served(s) for s in servers]
        r = generate(envoy.listener(listener), prompt)
        assert r.status_code == 200, r.text
        assert [served(s) - b for s, b in zip(servers, before)] == [0, 1], (
            f"turn {turn} left the server holding its pages"
        )
        if turn:
            assert r.json()["meta_info"]["cached_tokens"] >= (len(prompt) - 16 - 8) // PAGE * PAGE
        answers.append(r.json()["output_ids"])
        time.sleep(0.5)  # the server's KV events reach the picker's index
        if turn < 2:
            prompt = prompt + answers[-1] + list(range(2000 + 16 * turn, 2016 + 16 * turn))
    assert answers[-1] == generate(servers[0].url, prompt).json()["output_ids"]


def test_stream_through_envoy_ends_with_the_exact_tokens(servers, epp, envoy):
    ids = list(range(300, 350))
    want = generate(servers[0].url, ids, 12).json()["output_ids"]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", envoy.listener("fail_close") + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        stream = r.iter_lines()
        lines = [next(stream)]
        assert in_flight(epp) == 1  # the ext_proc stream lives as long as the request: the picker counts it
        lines += list(stream)
    deadline = time.monotonic() + 5
    while in_flight(epp) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_flight(epp) == 0
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(events) > 1 and events[-1]["output_ids"] == want
    assert [line for line in lines if line][-1] == "data: [DONE]"


def test_epp_death_follows_the_failure_mode(servers, epp, envoy):
    """The picker killed: FailOpen forwards to the gateway's own pick (the pool's round robin), FailClose answers
    no request (Envoy's ext_proc error); started again, both listeners are served by it again."""
    ids = list(range(500, 530))
    epp.signal(signal.SIGKILL)
    try:
        before = sum(served(s) for s in servers)
        opened = [generate(envoy.listener("fail_open"), ids) for _ in range(2)]
        assert [r.status_code for r in opened] == [200, 200]
        assert sum(served(s) for s in servers) - before == 2
        closed = generate(envoy.listener("fail_close"), ids)
        assert closed.status_code == 500, closed.text
        assert sum(served(s) for s in servers) - before == 2
    finally:
        epp.restart().wait_ready(60)
    deadline = time.monotonic() + 20
    while (r := generate(envoy.listener("fail_close"), ids)).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)  # Envoy's gRPC channel to the picker reconnects
    assert r.status_code == 200, r.text


def test_a_dead_server_is_dropped_within_the_health_bounds(servers, epp, envoy):
    """The second server killed: within the picker's health bounds (2 failed checks 0.5 s apart) it is out; every
    request lands on the first; the subset naming only the dead one is the protocol's 503."""
    servers[1].signal(signal.SIGKILL)
    killed = time.monotonic()
    while any(
        w["healthy"] for w in httpx.get(epp.url + "/workers", timeout=5).json()["workers"] if w["url"] == servers[1].url
    ):
        assert time.monotonic() - killed < 2 * 0.5 + 2 * 2.0 + 1, "the dead server is still in rotation"
        time.sleep(0.1)
    before = served(servers[0])
    for i in range(4):
        r = generate(envoy.listener("fail_close"), list(range(700 + i, 740 + i)))
        assert r.status_code == 200, r.text
    assert served(servers[0]) - before == 4
    r = generate(envoy.listener("subset"), list(range(800, 820)))
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
