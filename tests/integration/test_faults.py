"""Fault injection with real processes (built-in model, Mooncake TCP, 2 prefill + 2 decode + router):
SIGKILL and SIGSTOP of prefill and decode servers before, during and after a transfer, and clients
that vanish, with migration off (`--migration-limit 0`, the path of a fault when no other pair is left). Each test asserts that the client got an error naming the cause within the bound, that
every surviving node is back to idle with intact pools, and that later requests, also on the
restarted or resumed node, give exactly the monolithic tokens."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import ServerProcess, record_fault
from tests.integration.cluster import Cluster, generate, start_cluster
from tests.integration.faults import Background, RawClient, chunks_sent, finished, pages_held, router_sees, wait_until
from tests.integration.test_parity_hf import LONG_TEXT

ENGINE = ("--page-size", "16", "--chunked-prefill-size", "32")
FAULTS = ("--heartbeat-interval-s", "0.5", "--heartbeat-misses", "3", "--transfer-timeout-s", "5")
# --migration-limit 0: each fault's error reaches the client within its bound (test_migration.py: the moves)
ROUTER = ("--health-check-timeout-s", "1", "--health-failure-threshold", "2", "--migration-limit", "0")
BOUND_S = 6.0  # every fault must reach the client within this
STREAM_TOKENS = 40


@pytest.fixture(scope="module")
def prompts(builtin_model_dir) -> dict[str, list[int]]:
    tok = AutoTokenizer.from_pretrained(builtin_model_dir)
    return {
        # 5k tokens: the prefill still runs when the fault comes (the cut test model is fast)
        "long": tok.encode(LONG_TEXT * 16),
        "story": tok.encode("Once upon a time, in a village by the sea,"),
        "a": tok.encode("The weather today is"),
        "b": tok.encode("def quicksort(arr):"),
        "c": tok.encode("Three colours:"),
    }


@pytest.fixture(scope="module")
def expected(prompts, reference_servers) -> dict[str, list[int]]:
    mono = reference_servers.get(*ENGINE)  # test_netns_partitions.py's too
    want = {k: generate(mono.url, prompts[k], 8)["output_ids"] for k in ("a", "b", "c")}
    want["story"] = generate(mono.url, prompts["story"], STREAM_TOKENS, sampling={"ignore_eos": True})["output_ids"]
    return want


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster("mooncake", n_prefill=2, n_decode=2, flags=ENGINE + FAULTS, router_flags=ROUTER)
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def survivors_idle_after(cluster):
    yield
    for node in cluster.nodes:
        if node.proc.poll() is None:
            node.wait_idle()


def body(ids: list[int], new: int, stream: bool = False) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
        "stream": stream,
    }


def idle_time(nodes: list[ServerProcess], since: float) -> float:
    """Wait until every node holds no page; seconds since `since`."""
    for node in nodes:
        wait_until(lambda: pages_held(node) == 0, 20, f"{node.name} to free its pages")
        node.wait_idle()
    return time.monotonic() - since


def served_count(node: ServerProcess) -> float:
    return finished(node, "length") + finished(node, "stop")


def assert_serves_again(c: Cluster, node: ServerProcess, prompts, expected, since: float) -> float:
    """Requests through the router until `node` served one with exact tokens; seconds since `since`."""
    wait_until(lambda: router_sees(c.url, node, healthy=True), 30, f"the router to use {node.name} again")
    before = served_count(node)
    for key in ["a", "b", "c"] * 2:
        assert generate(c.url, prompts[key], 8)["output_ids"] == expected[key]
        if served_count(node) > before:
            return time.monotonic() - since
    raise AssertionError(f"{node.name} is healthy but was never used")


def restart(node: ServerProcess) -> float:
    t = time.monotonic()
    node.restart().wait_ready()
    return t


def victim_transferring(c: Cluster, before: dict[str, float]) -> ServerProcess:
    """The prefill that started sending chunks since `before` was taken."""

    def sending() -> list[ServerProcess]:
        return [p for p in c.prefills if chunks_sent(p) > before[p.url]]

    wait_until(lambda: bool(sending()), 60, "a prefill to send KV chunks")
    return sending()[0]


def test_prefill_killed_during_and_before_transfer(cluster, prompts, expected):
    before = {p.url: chunks_sent(p) for p in cluster.prefills}
    long_req = Background(cluster.url, body(prompts["long"], 4))
    victim = victim_transferring(cluster, before)
    queued, others = None, []
    for key in ("a", "b", "c"):  # round robin: one of these queues on the victim behind the long prompt
        req = Background(cluster.url, body(prompts[key], 8))
        try:
            wait_until(lambda: victim.info()["num_waiting_reqs"] >= 1, 2, "a request queued on the victim")
            queued = req
            break
        except AssertionError:
            others.append((key, req))
    assert queued is not None and long_req.outcome.ended_at is None, "the long prefill ended before the fault"
    t_kill = time.monotonic()
    victim.signal(signal.SIGKILL)
    for name, req in (("during", long_req), ("before", queued)):
        o = req.wait()
        assert o.status in (502, 503), (name, o)
        assert "prefill" in o.error_message, (name, o.error_message)
        assert o.ended_at - t_kill < BOUND_S, (name, o.ended_at - t_kill)
    for key, req in others:
        assert req.wait().output_ids == expected[key]
    survivors = [n for n in cluster.nodes if n is not victim]
    leaked_after = idle_time(survivors, t_kill)
    assert generate(cluster.url, prompts["a"], 8)["output_ids"] == expected["a"]
    recovery = assert_serves_again(cluster, victim, prompts, expected, restart(victim))
    for name, req in (("during", long_req), ("before (queued behind it)", queued)):
        o = req.outcome
        record_fault(
            f"prefill SIGKILL {name} transfer",
            f"HTTP {o.status}: {o.error_message[:60]}",
            o.ended_at - t_kill,
            0,
            recovery,
        )
    assert leaked_after < 20


def test_prefill_killed_after_transfer_leaves_the_stream_intact(cluster, prompts, expected):
    before = {p.url: served_count(p) for p in cluster.prefills}
    stream = Background(cluster.url, body(prompts["story"], STREAM_TOKENS, stream=True))
    wait_until(lambda: len(stream.outcome.events) >= 2, 60, "the first streamed tokens")
    victim = next(p for p in cluster.prefills if served_count(p) > before[p.url])
    victim.signal(signal.SIGKILL)
    o = stream.wait()
    assert o.status == 200 and o.error is None and o.done_marker
    assert o.output_ids == expected["story"]
    idle_time([n for n in cluster.nodes if n is not victim], time.monotonic())
    recovery = assert_serves_again(cluster, victim, prompts, expected, restart(victim))
    record_fault("prefill SIGKILL after transfer", f"HTTP 200, all {STREAM_TOKENS} tokens exact", None, 0, recovery)


def test_decode_killed_mid_stream(cluster, prompts, expected):
    stream = Background(cluster.url, body(prompts["story"], 400, stream=True))
    wait_until(lambda: len(stream.outcome.events) >= 3, 60, "the first streamed tokens")
    victim = next(d for d in cluster.decodes if d.info()["num_running_reqs"] >= 1)
    t_kill = time.monotonic()
    victim.signal(signal.SIGKILL)
    o = stream.wait()
    assert o.status == 200 and o.done_marker and o.error is not None, o
    assert victim.url in o.error, o.error
    assert o.ended_at - t_kill < BOUND_S
    assert o.output_ids == expected["story"][: len(o.output_ids)]  # what did arrive was right
    idle_time([n for n in cluster.nodes if n is not victim], t_kill)
    assert generate(cluster.url, prompts["b"], 8)["output_ids"] == expected["b"]
    recovery = assert_serves_again(cluster, victim, prompts, expected, restart(victim))
    record_fault("decode SIGKILL mid-stream", f"SSE error event: {o.error[:60]}", o.ended_at - t_kill, 0, recovery)


def test_prefill_frozen_mid_transfer(cluster, prompts, expected):
    before = {p.url: chunks_sent(p) for p in cluster.prefills}
    req = Background(cluster.url, body(prompts["long"], 4))
    victim = victim_transferring(cluster, before)
    t_stop = time.monotonic()
    victim.signal(signal.SIGSTOP)
    try:
        o = req.wait()
        assert o.status in (502, 503, 504), o
        assert "heartbeat" in o.error_message or "health" in o.error_message, o.error_message
        assert o.ended_at - t_stop < BOUND_S
        idle_time([n for n in cluster.nodes if n is not victim], t_stop)
        assert generate(cluster.url, prompts["c"], 8)["output_ids"] == expected["c"]
    finally:
        victim.signal(signal.SIGCONT)
    t_cont = time.monotonic()
    victim.wait_idle()
    recovery = assert_serves_again(cluster, victim, prompts, expected, t_cont)
    record_fault(
        "prefill SIGSTOP mid-transfer (SIGCONT later)",
        f"HTTP {o.status}: {o.error_message[:60]}",
        o.ended_at - t_stop,
        0,
        recovery,
    )


def test_decode_frozen_mid_stream(cluster, prompts, expected):
    stream = Background(cluster.url, body(prompts["story"], 400, stream=True))
    wait_until(lambda: len(stream.outcome.events) >= 3, 60, "the first streamed tokens")
    victim = next(d for d in cluster.decodes if d.info()["num_running_reqs"] >= 1)
    t_stop = time.monotonic()
    victim.signal(signal.SIGSTOP)
    try:
        o = stream.wait()
        assert o.status == 200 and o.done_marker and o.error is not None, o
        assert victim.url in o.error, o.error
        assert o.ended_at - t_stop < BOUND_S
        idle_time(cluster.prefills, t_stop)
        assert generate(cluster.url, prompts["a"], 8)["output_ids"] == expected["a"]
    finally:
        victim.signal(signal.SIGCONT)
    t_cont = time.monotonic()
    victim.wait_idle()
    recovery = assert_serves_again(cluster, victim, prompts, expected, t_cont)
    record_fault(
        "decode SIGSTOP mid-stream (SIGCONT later)",
        f"SSE error event: {o.error[:60]}",
        o.ended_at - t_stop,
        0,
        recovery,
    )


def test_client_gone_before_the_first_token_aborts_both_halves(cluster, prompts):
    before = {p.url: chunks_sent(p) for p in cluster.prefills}
    aborts = {n.url: finished(n, "abort") for n in cluster.nodes}
    client = RawClient(cluster.router, "/generate", body(prompts["long"], 8, stream=True))
    victim_transferring(cluster, before)  # prefill computing and sending; decode waiting for KV
    client.close()
    t_gone = time.monotonic()
    wait_until(
        lambda: sum(finished(n, "abort") - aborts[n.url] for n in cluster.nodes) >= 2, BOUND_S, "both halves to abort"
    )
    took = time.monotonic() - t_gone
    assert sum(finished(p, "abort") > aborts[p.url] for p in cluster.prefills) == 1
    assert sum(finished(d, "abort") > aborts[d.url] for d in cluster.decodes) == 1
    idle = idle_time(cluster.nodes, t_gone)
    record_fault("client disconnect before first token", "(gone) both halves aborted", took, 0, idle)


def test_client_gone_mid_stream_aborts_the_decode(cluster, prompts):
    aborts = {d.url: finished(d, "abort") for d in cluster.decodes}
    with httpx.stream(
        "POST", cluster.url + "/generate", json=body(prompts["story"], 400, stream=True), timeout=60
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    t_gone = time.monotonic()
    wait_until(
        lambda: sum(finished(d, "abort") - aborts[d.url] for d in cluster.decodes) == 1, BOUND_S, "the decode to abort"
    )
    took = time.monotonic() - t_gone
    idle = idle_time(cluster.nodes, t_gone)
    record_fault("client disconnect mid-stream", "(gone) decode aborted", took, 0, idle)
