"""Inputs and faults nobody injected before, with real processes (tiny model, Mooncake TCP, router):
clients that repeat identifiers, prefill-only requests, a dead prefill's pages, several prefills on one
standalone bootstrap registry, a forged decode with another layout, and servers exposed without a
secret. Each test checks exact tokens, status codes and pool counts."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import zmq

from tests.conftest import metric, record_fault, start_server
from tests.integration.cluster import generate, start_cluster
from tests.integration.faults import Background, RawClient, pages_held, wait_until
from tests.integration.tiny_model import random_prompts
from transfer.messages import Register, RoomRequest, decode, encode

ENGINE = ("--page-size", "4", "--chunked-prefill-size", "32")  # what the output depends on
FLAGS = (*ENGINE, "--heartbeat-interval-s", "0.5", "--transfer-timeout-s", "60")
PROMPTS = random_prompts(6, 12, 40, seed=11)
NEW = 8
NO_MOVES = ("--migration-limit", "0")  # the client sees the dead prefill's 502 (test_migration.py: the moves)


def body(ids: list[int], new: int = NEW, **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}, **extra}


@pytest.fixture(scope="module")
def mono(tiny_model_dir, reference_servers):
    return reference_servers.get("--model", str(tiny_model_dir), *ENGINE)  # test_soak.py's


@pytest.fixture(scope="module")
def expected(mono) -> list[list[int]]:
    return [generate(mono.url, p, NEW, sampling={"ignore_eos": True})["output_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    c = start_cluster("mooncake", flags=("--model", str(tiny_model_dir), *FLAGS))
    yield c
    c.stop()


def test_concurrent_requests_sharing_a_rid_each_get_their_own_output(cluster, expected):
    reqs = [Background(cluster.url, body(p, rid="the-same-rid", stream=i % 2 == 1)) for i, p in enumerate(PROMPTS)]
    for i, r in enumerate(reqs):
        o = r.wait(60)
        assert o.status == 200 and o.error is None, (i, o)
        assert o.output_ids == expected[i], i
    for node in cluster.nodes:
        assert httpx.get(node.url + "/health", timeout=5).status_code == 200
    assert generate(cluster.url, PROMPTS[0], NEW, sampling={"ignore_eos": True})["output_ids"] == expected[0]
    cluster.wait_idle()


def test_a_room_id_already_in_use_on_a_server_is_a_409(cluster):
    prefill, boot = cluster.prefills[0], cluster.prefill_bootstrap_ports[0]
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": 4242}
    first = RawClient(prefill, "/generate", body(PROMPTS[0], **pd))  # waits for a decode that never comes
    wait_until(lambda: prefill.info()["role"]["awaiting_decode"] == 1, 10, "the first request to wait for its decode")
    r = httpx.post(prefill.url + "/generate", json=body(PROMPTS[1], **pd), timeout=10)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["message"] == "bootstrap_room 4242 is already in use on this prefill server"
    first.close()  # the client goes away: its request is aborted and its room freed
    wait_until(lambda: prefill.info()["role"]["awaiting_decode"] == 0, 10, "the first request to be aborted")
    cluster.wait_idle()


def test_client_supplied_pd_fields_are_replaced_by_the_router(cluster, expected):
    forged = {"bootstrap_room": 7, "bootstrap_host": "10.9.9.9", "bootstrap_port": 1, "prefill_instance_id": "nobody"}
    reqs = [Background(cluster.url, body(p, **forged)) for p in PROMPTS[:3]]
    assert [r.wait(60).output_ids for r in reqs] == expected[:3]


def test_max_new_tokens_zero_returns_no_tokens_but_prompt_logprobs(cluster, mono):
    ask = {
        "input_ids": PROMPTS[2],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    want = httpx.post(mono.url + "/generate", json=ask, timeout=60).json()
    got = httpx.post(cluster.url + "/generate", json=ask, timeout=60).json()
    for r in (want, got):
        assert r["output_ids"] == [] and r["text"] == "" and r["meta_info"]["completion_tokens"] == 0
        assert r["meta_info"]["finish_reason"]["type"] == "length"
        assert [t for _, t, _ in r["meta_info"]["input_token_logprobs"]] == PROMPTS[2]
    lp_want = [lp for lp, _, _ in want["meta_info"]["input_token_logprobs"]]
    lp_got = [lp for lp, _, _ in got["meta_info"]["input_token_logprobs"]]
    assert lp_want[0] is None and lp_got[0] is None
    assert lp_got[1:] == pytest.approx(lp_want[1:], abs=1e-4)
    openai = httpx.post(
        cluster.url + "/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 0}, timeout=60
    ).json()
    assert openai["choices"][0]["text"] == "" and openai["usage"]["completion_tokens"] == 0
    cluster.wait_idle()


def test_a_killed_prefills_pages_on_the_decode_come_back_within_the_heartbeat_window(tiny_model_dir, expected):
    """The prefill is frozen while the decode holds pages for it, then killed: the decode frees those
    pages one heartbeat interval after declaring it dead, not after --transfer-timeout-s (60 s)."""
    c = start_cluster(
        "mooncake",
        n_prefill=2,
        flags=("--model", str(tiny_model_dir), *FLAGS),
        standalone_bootstrap=True,
        router_flags=NO_MOVES,
    )
    try:
        decode, victim = c.decodes[0], c.prefills[0]
        victim.signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        stuck = [Background(c.url, body(p)) for p in PROMPTS[:2]]  # round robin: one lands on the victim
        wait_until(
            lambda: decode.info()["role"]["transferring"] + decode.info()["role"]["quarantined"] >= 1,
            10,
            "the decode to reserve pages for the frozen prefill",
        )
        held = pages_held(decode)
        victim.signal(signal.SIGKILL)
        outcomes = [r.wait(30) for r in stuck]
        assert sorted(o.status for o in outcomes) == [200, 502], outcomes
        freed_after = wait_until(lambda: pages_held(decode) == 0, 20, "the decode to free the dead prefill's pages")
        took = time.monotonic() - t_stop
        assert took < 0.5 * 2 + 0.5 + 1.0 + 2.0  # window + one interval + clock slack + polling; not 60 s
        failed = next(o for o in outcomes if o.status == 502)
        record_fault(
            "prefill frozen then SIGKILLed, decode holding its pages",
            f"HTTP 502: {failed.error_message[:50]}",
            failed.ended_at - t_stop,
            0,
            None,
        )
        print(
            f"decode held {held} pages for the dead prefill; freed {freed_after:.2f} s after the kill, {took:.2f} s after the freeze"
        )
        for i, p in enumerate(PROMPTS):  # the survivor reuses those pages: every token exact
            assert generate(c.url, p, NEW, sampling={"ignore_eos": True})["output_ids"] == expected[i]
        decode.wait_idle()
    finally:
        c.stop()


def test_a_frozen_prefill_that_wakes_up_writes_nothing_into_reused_pages(tiny_model_dir, expected):
    c = start_cluster(
        "mooncake",
        n_prefill=2,
        flags=("--model", str(tiny_model_dir), *FLAGS),
        standalone_bootstrap=True,
        router_flags=NO_MOVES,
    )
    try:
        decode, victim = c.decodes[0], c.prefills[0]
        victim.signal(signal.SIGSTOP)
        stuck = [Background(c.url, body(p)) for p in PROMPTS[:2]]
        assert sorted(r.wait(30).status for r in stuck) == [200, 502]
        wait_until(lambda: pages_held(decode) == 0, 20, "the decode to free the frozen prefill's pages")
        busy = [Background(c.url, body(p, new=40)) for p in PROMPTS]  # the freed pages are in use again ...
        victim.signal(signal.SIGCONT)  # ... when the frozen prefill wakes up
        for i, r in enumerate(busy):
            o = r.wait(60)
            if o.status == 200:
                want = generate(c.url, PROMPTS[i], 40, sampling={"ignore_eos": True})["output_ids"]
                assert o.output_ids == want, i
        print(
            f"fenced writes of the woken prefill: {metric(victim.url, 'tandem_kv_transfer_events_total', event='writes_fenced')}"
        )
        for i, p in enumerate(PROMPTS):
            assert generate(c.url, p, NEW, sampling={"ignore_eos": True})["output_ids"] == expected[i]
        c.wait_idle()
    finally:
        c.stop()


def test_one_standalone_bootstrap_two_prefills_two_decodes_match_monolithic(tiny_model_dir, expected):
    c = start_cluster(
        "mooncake", n_prefill=2, n_decode=2, flags=("--model", str(tiny_model_dir), *FLAGS), standalone_bootstrap=True
    )
    try:
        reqs = [Background(c.url, body(p)) for p in PROMPTS * 2]
        assert [r.wait(60).output_ids for r in reqs] == expected * 2
        assert all(metric(p.url, "tandem_requests_finished_total", reason="length") >= 1 for p in c.prefills)
        assert httpx.get(c.bootstrap.url + "/health", timeout=5).json()["registered"] == 2
        r = httpx.get(c.bootstrap.url + "/route", params={"engine_rank": 0, "target_dp_group": 0}, timeout=5)
        assert r.status_code == 409 and "name one with instance_id" in r.json()["error"]["message"]
        c.wait_idle()
    finally:
        c.stop()


def test_a_decode_registering_another_layout_is_refused_with_the_field_named(cluster):
    prefill = cluster.prefills[0]
    endpoint = prefill.info()["role"]["control_endpoint"]
    ctx = zmq.Context.instance()
    inbox = ctx.socket(zmq.PULL)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    kv_heads = 2  # the tiny model's (save_tiny_llama): the liar differs in bytes_per_page alone
    liar = Register("liar", f"tcp://127.0.0.1:{port}", [b"127.0.0.1:1"], [4096], [64], 8, 4, 4096, 188, 2, 1, kv_heads)
    out = ctx.socket(zmq.PUSH)
    out.connect(endpoint)
    refused_before = metric(prefill.url, "tandem_kv_transfer_events_total", event="peers_refused")
    out.send(encode(liar, None))
    out.send(encode(RoomRequest(31337, "liar", [1], 0), None))
    assert inbox.poll(5000), "the prefill never answered the refused decode"
    status = decode(inbox.recv(), None)
    assert status.room_id == 31337 and not status.ok and "bytes_per_page" in status.reason
    assert metric(prefill.url, "tandem_kv_transfer_events_total", event="peers_refused") == refused_before + 1
    out.close(linger=0)
    inbox.close(linger=0)
    assert httpx.get(prefill.url + "/health", timeout=5).status_code == 200


def test_a_server_exposed_without_a_cluster_secret_says_so_at_start_up(tiny_model_dir):
    server = start_server(
        "--disaggregation-mode", "decode", "--model", str(tiny_model_dir), "--host", "0.0.0.0", name="rb-exposed"
    )
    try:
        wait_until(lambda: "WITHOUT --cluster-secret" in server.log_path.read_text(errors="replace"), 60, "the warning")
        log = server.log_path.read_text(errors="replace")
        assert "WITHOUT --api-key" in log and "TANDEM_CLUSTER_SECRET" in log
    finally:
        server.stop()


def test_health_answers_503_naming_a_stuck_step(builtin_model_dir):
    """A forward longer than --watchdog-timeout-s makes /health fail with the cause, then recover."""
    server = start_server(
        "--chunked-prefill-size", "0", "--max-prefill-tokens", "8192", "--watchdog-timeout-s", "0.2", name="rb-watchdog"
    ).wait_ready()
    try:
        long = Background(server.url, body([100 + i % 1000 for i in range(3000)], new=1))
        seen: list[dict] = []

        def unhealthy() -> bool:
            r = httpx.get(server.url + "/health", timeout=10)
            if r.status_code == 503:
                seen.append(r.json())
            return bool(seen)

        wait_until(unhealthy, 60, "/health to answer 503 during the long forward", interval=0.02)
        assert "scheduler step has been running for" in seen[0]["error"]["message"]
        assert long.wait(120).status == 200
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        server.stop()
