"""What /metrics says, exactly, about what real processes did (1 prefill + 1 decode + router, tiny model,
Mooncake TCP): N requests are N everywhere they are counted, a request in flight is one on each worker
it uses, and a room that fails is counted once under its cause."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from tests.conftest import sample
from tests.integration.cluster import Cluster, generate, start_cluster
from tests.integration.faults import RawClient, wait_until
from tests.integration.tiny_model import random_prompts
from transfer.metrics import CAUSES

PAGE = 4
FLAGS = ("--page-size", str(PAGE), "--chunked-prefill-size", "32", "--heartbeat-interval-s", "0.5")
KV_WAIT_S = 2
NEW = 8


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    c = start_cluster(
        "mooncake", flags=("--model", str(tiny_model_dir), *FLAGS), decode_flags=("--kv-wait-timeout-s", str(KV_WAIT_S))
    )
    yield c
    c.stop()


def scrape(url: str) -> str:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


def value(text: str, name: str, role: str, **labels: str) -> float:
    return sample(text, name, {**labels, "role": role})


def failures(text: str, role: str) -> dict[str, float]:
    return {cause: value(text, "tandem_kv_transfer_failures_total", role, cause=cause) for cause in CAUSES}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def workers(c: Cluster) -> list[dict[str, str]]:
    """The router's labels of its two workers."""
    return [
        {"worker": c.prefills[0].url, "worker_role": "prefill"},
        {"worker": c.decodes[0].url, "worker_role": "decode"},
    ]


def bytes_per_page(c: Cluster) -> int:
    """All layers' K and V of one page, from the layout the prefill registered with its bootstrap registry."""
    instance = c.prefills[0].info()["role"]["instance_id"]
    boot = f"http://127.0.0.1:{c.prefill_bootstrap_ports[0]}"
    layout = httpx.get(boot + "/route", params={"instance_id": instance}, timeout=10).json()
    per_buffer = (
        layout["page_size"] * layout["kv_heads"] * layout["head_dim"] * getattr(torch, layout["dtype"]).itemsize
    )
    return 2 * layout["num_layers"] * per_buffer


def test_n_requests_are_counted_n_times_on_every_process(cluster):
    c, prompts = cluster, random_prompts(3, 9, 40, seed=21)
    prefill, decode = c.prefills[0], c.decodes[0]
    before = {p.name: scrape(p.url) for p in (prefill, decode, c.router)}
    for ids in prompts:
        generate(c.url, ids, NEW, sampling={"ignore_eos": True})
    c.wait_idle()
    after = {p.name: scrape(p.url) for p in (prefill, decode, c.router)}
    n, pages = len(prompts), sum(math.ceil(len(p) / PAGE) for p in prompts)

    def grew(node, name: str, role: str, **labels: str) -> float:
        return value(after[node.name], name, role, **labels) - value(before[node.name], name, role, **labels)

    r = c.router
    assert grew(r, "tandem_router_requests_total", "router", endpoint="/generate", status="200") == n
    assert grew(r, "tandem_router_request_latency_seconds_count", "router") == n
    for role, node in (("prefill", prefill), ("decode", decode)):
        assert grew(node, "tandem_requests_finished_total", role, reason="length") == n
        assert grew(node, "tandem_time_to_first_token_seconds_count", role) == n
        assert grew(node, "tandem_kv_transfer_events_total", role, event="rooms_succeeded") == n
        assert grew(node, "tandem_kv_transfer_latency_seconds_count", role) == n
        assert grew(node, "tandem_prompt_tokens_total", role) == sum(map(len, prompts))
        assert delta(failures(after[node.name], role), failures(before[node.name], role)) == {}
    assert grew(decode, "tandem_generation_tokens_total", "decode") == n * NEW
    assert grew(decode, "tandem_inter_token_latency_seconds_count", "decode") == n * (NEW - 1)
    assert grew(prefill, "tandem_kv_transfer_events_total", "prefill", event="bytes_sent") == pages * bytes_per_page(c)
    assert grew(prefill, "tandem_kv_pages_cached", "prefill") == sum(len(p) // PAGE for p in prompts)  # full pages only

    for role, node in (("prefill", prefill), ("decode", decode)):
        text = after[node.name]
        kv = {s: value(text, f"tandem_kv_pages_{s}", role) for s in ("used", "cached", "free", "total")}
        assert kv["used"] == 0 and kv["used"] + kv["cached"] + kv["free"] == kv["total"]
        queues = ("awaiting_decode", "inflight") if role == "prefill" else ("prealloc", "transferring", "quarantined")
        assert [value(text, "tandem_pd_queue_requests", role, queue=q) for q in queues] == [0] * len(queues)
    for labels in workers(c):
        assert value(after["router"], "tandem_router_worker_healthy", "router", **labels) == 1
        assert value(after["router"], "tandem_router_worker_in_flight_requests", "router", **labels) == 0


def test_a_stream_in_flight_is_one_request_on_each_worker_of_its_pair(cluster):
    c = cluster
    body = {
        "input_ids": random_prompts(1, 20, 20, seed=22)[0],
        "stream": True,
        "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True},
    }
    client = RawClient(c.router, "/generate", body)
    client.read_until(b"data:")  # the first token reached the client: the pair is busy with it
    text = scrape(c.router.url)
    assert value(text, "tandem_router_in_flight_requests", "router") == 1
    for labels in workers(c):
        assert value(text, "tandem_router_worker_in_flight_requests", "router", **labels) == 1
    assert value(scrape(c.decodes[0].url), "tandem_num_running_reqs", "decode") == 1
    client.close()  # the client goes away: the router ends both halves
    wait_until(
        lambda: value(scrape(c.router.url), "tandem_router_in_flight_requests", "router") == 0, 20, "the stream to end"
    )
    text = scrape(c.router.url)
    for labels in workers(c):
        assert value(text, "tandem_router_worker_in_flight_requests", "router", **labels) == 0
    c.wait_idle()


def test_a_room_id_in_use_counts_one_duplicate_and_the_waiting_room_one_abort(cluster):
    prefill, boot = cluster.prefills[0], cluster.prefill_bootstrap_ports[0]
    before = failures(scrape(prefill.url), "prefill")
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": 5151}
    body = {"input_ids": random_prompts(1, 12, 12, seed=23)[0], "sampling_params": {"max_new_tokens": NEW}, **pd}
    first = RawClient(prefill, "/generate", body)  # waits for a decode that never comes
    awaiting = lambda: value(scrape(prefill.url), "tandem_pd_queue_requests", "prefill", queue="awaiting_decode")  # noqa: E731
    wait_until(lambda: awaiting() == 1, 10, "the first request to wait for its decode")
    assert httpx.post(prefill.url + "/generate", json=body, timeout=10).status_code == 409
    assert delta(failures(scrape(prefill.url), "prefill"), before) == {"duplicate": 1}
    first.close()  # the client goes away: its room fails as aborted
    wait_until(lambda: awaiting() == 0, 10, "the first request to be aborted")
    assert delta(failures(scrape(prefill.url), "prefill"), before) == {"duplicate": 1, "aborted": 1}
    cluster.wait_idle()


def test_a_decode_whose_kv_never_comes_counts_one_timeout(cluster):
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    before = {"prefill": failures(scrape(prefill.url), "prefill"), "decode": failures(scrape(decode.url), "decode")}
    pd = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.prefill_bootstrap_ports[0],
        "bootstrap_room": 6161,
        "prefill_instance_id": prefill.info()["role"]["instance_id"],
    }
    body = {"input_ids": random_prompts(1, 12, 12, seed=24)[0], "sampling_params": {"max_new_tokens": NEW}, **pd}
    r = httpx.post(decode.url + "/generate", json=body, timeout=30)  # no prefill request computes room 6161
    assert r.status_code == 502 and f"no KV arrived within {KV_WAIT_S} s" in r.json()["error"]["message"]
    cluster.wait_idle()
    assert delta(failures(scrape(decode.url), "decode"), before["decode"]) == {"timeout": 1}
    assert delta(failures(scrape(prefill.url), "prefill"), before["prefill"]) == {}  # it never owned the room
