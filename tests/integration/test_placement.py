"""Placement and role switches end to end (docs/placement.md), on one cluster of a tiny Llama shared by the module:
a prefill and two decodes that may all switch roles (--enable-pd-role-switch) and publish KV events, a router that
places by the measured cost (--pd-placement cost) and one that always computes on the prefill. Greedy output
equals the monolithic server's whatever the placement (remote, decode-local forced by x-bypass-remote-prefill, the
cost's choice; a conversation's turns); bad headers and fields are 400s naming them; a decode flips to prefill and
back under load with every request answered, each equal to the monolithic answer; every pool is idle after."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.conftest import ServerProcess, metric, start_server
from tests.integration.cluster import Cluster, generate, start_router
from tests.integration.tiny_model import random_prompts
from tests.ports import free_port

PAGE, CHUNK, NEW = 16, 64, 12
EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
COST = ("--pd-placement", "cost", "--placement-poll-interval-s", "0.5", "--health-check-interval-s", "0.5")
pytestmark = pytest.mark.timeout(900)


def flags(model) -> tuple[str, ...]:
    return ("--model", str(model), "--page-size", str(PAGE), "--chunked-prefill-size", str(CHUNK))


@pytest.fixture(scope="module")
def mono(reference_servers, tiny_model_dir):
    return reference_servers.get(*flags(tiny_model_dir))


@pytest.fixture(scope="module")
def cluster(mono, tiny_model_dir):
    """Every server may switch; each has a bootstrap port of its own for when it is a prefill."""
    common = (*flags(tiny_model_dir), "--kv-events-config", EVENTS, "--enable-pd-role-switch")
    c = Cluster(policy="kv_aware", router_args=COST)
    try:
        for name, mode in (("prefill0", "prefill"), ("decode0", "decode"), ("decode1", "decode")):
            server = start_server(
                "--disaggregation-mode", mode, "--bootstrap-port", str(free_port()), *common, name=name
            )
            (c.prefills if mode == "prefill" else c.decodes).append(server)
        c.spawn_router()
        c.wait_ready(600)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def remote_router(cluster):
    pairs = list(zip(cluster.prefills, cluster.prefill_bootstrap_ports))
    router = start_router(pairs, cluster.decodes, "--health-check-interval-s", "0.5", name="router-remote")
    yield router
    router.stop()


def ask(url: str, prompt: list[int], headers: dict[str, str] | None = None, stream: bool = False) -> list[int]:
    """The greedy output ids of `prompt` (streamed or not)."""
    body = {"input_ids": prompt, "stream": stream, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}
    r = httpx.post(url + "/generate", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["output_ids"]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "error" not in events[-1], events[-1]
    return events[-1]["output_ids"]


def placements(url: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.labels["path"], s.labels["reason"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "tandem_router_placement_total"
    }


LOCAL = {"x-bypass-remote-prefill": "true"}


def test_every_placement_equals_monolithic(cluster, remote_router, mono):
    prompts = [*random_prompts(3, 5, 40, seed=1), *random_prompts(2, 300, 600, seed=2)]
    before = placements(cluster.url)
    for prompt in prompts:
        expected = generate(mono.url, prompt, NEW)["output_ids"]
        assert ask(remote_router.url, prompt) == expected
        assert ask(cluster.url, prompt, LOCAL) == expected
        assert ask(cluster.url, prompt, LOCAL, stream=True) == expected
        assert ask(cluster.url, prompt, stream=True) == expected  # the cost's choice
    after = placements(cluster.url)
    assert after.get(("local", "forced"), 0) - before.get(("local", "forced"), 0) == 2 * len(prompts)
    assert sum(after.values()) - sum(before.values()) == 3 * len(prompts)
    cluster.wait_idle()


def test_a_conversation_equals_monolithic_turn_after_turn(cluster, mono):
    """Each turn is the last turn's prompt and answer and new tokens: the decode that served it holds most of it."""
    [prompt] = random_prompts(1, 200, 200, seed=3)
    for turn, new in enumerate(random_prompts(4, 20, 20, seed=4)):
        expected = generate(mono.url, prompt, NEW)["output_ids"]
        assert ask(cluster.url, prompt, stream=True) == expected, f"turn {turn}"
        prompt = prompt + expected + new
    cluster.wait_idle()


def test_bad_headers_and_placement_fields_are_400s_naming_them(cluster):
    r = httpx.post(cluster.url + "/generate", json={"input_ids": [1]}, headers={"x-slo-ttft-ms": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-slo-ttft-ms"
    r = httpx.post(cluster.prefills[0].url + "/generate", json={"input_ids": [1], "pd_placement": "local"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "pd_placement"
    body = {"input_ids": [1], "pd_placement": "local", "bootstrap_room": 7}
    r = httpx.post(cluster.decodes[0].url + "/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "pd_placement"
    r = httpx.post(cluster.decodes[0].url + "/pd_role_switch", json={"new_role": "router"})
    assert r.status_code == 400 and r.json()["success"] is False


def roles(router_url: str) -> dict[str, str]:
    return {w["url"]: w["role"] for w in httpx.get(router_url + "/workers", timeout=10).json()["workers"]}


def test_a_decode_flips_to_prefill_and_back_under_load_losing_nothing(cluster, mono):
    prompts = [*random_prompts(4, 8, 40, seed=5), *random_prompts(2, 200, 400, seed=6)]
    expected = [generate(mono.url, p, NEW)["output_ids"] for p in prompts]
    answers: list[tuple[int, list[int] | str]] = []
    stop = threading.Event()

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            try:
                answers.append((i % len(prompts), ask(cluster.url, prompts[i % len(prompts)], stream=i % 2 == 0)))
            except AssertionError as e:
                answers.append((i % len(prompts), str(e)))
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        flipping = cluster.decodes[1]
        time.sleep(2)
        for role in ("prefill", "decode"):
            r = httpx.post(cluster.url + "/pd_role_switch", json={"url": flipping.url, "new_role": role}, timeout=400)
            assert r.status_code == 200 and r.json()["new_role"] == role, r.text
            assert roles(cluster.url)[flipping.url] == role
            time.sleep(3)  # the load runs on the new roles
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(answers) >= 10
    failed = [(i, a) for i, a in answers if a != expected[i]]
    assert failed == [], failed[:3]
    assert metric(flipping.url, "tandem_forward_steps_total", mode="decode") > 0
    cluster.wait_idle()


def test_the_planner_flips_a_decode_to_prefill_when_ttft_is_over_its_target(cluster, remote_router, mono):
    """sla mode with a TTFT target no prompt meets and an ITL target every token does: the prefill side is over its
    target, so one of the two decodes becomes a prefill within a few intervals; no request fails meanwhile. The load
    and the planner go through the router that computes every prompt on the prefill: the cost router places these
    short prompts on the decodes as often as not, and a prefill that computes nothing adds no TTFT to flip for (the
    planner rightly keeps its roles then)."""
    port = free_port()
    planner = ServerProcess(
        ["planner", "--router", remote_router.url, "--mode", "sla", "--ttft-ms", "1", "--itl-ms", "100000",
         "--interval-s", "1", "--hysteresis", "2", "--cooldown-s", "0", "--port", str(port)],
        port, name="planner",
    )  # fmt: skip
    prompts = random_prompts(4, 8, 60, seed=7)
    expected = [generate(mono.url, p, NEW)["output_ids"] for p in prompts]
    answers: list[tuple[int, list[int] | str]] = []
    stop = threading.Event()

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            try:
                answers.append((i % len(prompts), ask(remote_router.url, prompts[i % len(prompts)], stream=True)))
            except AssertionError as e:
                answers.append((i % len(prompts), str(e)))
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    flipped = None
    try:
        planner.wait_ready(60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and flipped is None:
            prefills = [u for u, role in roles(remote_router.url).items() if role == "prefill"]
            flipped = next((d for d in cluster.decodes if d.url in prefills), None)
            time.sleep(0.5)
        decisions = metric(planner.url, "tandem_planner_decisions_total", action="to_prefill")
        done = metric(planner.url, "tandem_planner_actions_total", outcome="done")
    finally:
        planner.stop()
        stop.set()
        for t in threads:
            t.join()
    assert flipped is not None, planner.log_tail()
    assert decisions == 1 and done == 1  # then min_servers: the last decode stays
    failed = [(i, a) for i, a in answers if a != expected[i]]
    assert failed == [] and len(answers) >= 5, failed[:3]
    r = httpx.post(remote_router.url + "/pd_role_switch", json={"url": flipped.url, "new_role": "decode"}, timeout=400)
    assert r.status_code == 200, r.text
    cluster.wait_idle()
