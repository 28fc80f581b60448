"""Placement and role switches end to end (docs/placement.md), on one cluster of a tiny Llama shared by the module:
a prefill and two decodes that may all switch roles (--enable-pd-role-switch) and publish KV events, a router that
places by the measured cost (--pd-placement cost) and one that always computes on the prefill. Greedy output
equals the monolithic server's whatever the placement (remote, decode-local forced by x-bypass-remote-prefill, the
cost's choice; a conversation's turns); bad headers and fields are 400s naming them; a half meant for the other
role is refused at once (409 naming the server's role); a decode flips to prefill and back under load with every
request answered, each equal to the monolithic answer, also when switched through its own endpoint behind a router
that learns it only from those refusals (no answer more than a few seconds slower); every pool is idle after."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.conftest import ServerProcess, metric, start_server
from tests.integration.cluster import Cluster, generate, start_router
from tests.integration.faults import wait_until
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


def test_a_half_meant_for_the_other_role_is_refused_at_once_naming_the_servers_role(cluster):
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    body = {"input_ids": [1, 2, 3], "bootstrap_room": 7, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1}
    for server, meant, role in ((decode, "prefill", "decode"), (prefill, "decode", "prefill")):
        started = time.monotonic()
        r = httpx.post(server.url + "/generate", json=body, headers={"X-Tandem-Role": meant}, timeout=10)
        assert time.monotonic() - started < 2  # answered before any room is waited for
        assert r.status_code == 409 and r.json()["error"]["param"] == "X-Tandem-Role", r.text
        assert r.headers["X-Tandem-Role"] == role and r.headers["X-Tandem-Instance-Id"]
        assert ("X-Tandem-Bootstrap" in r.headers) == (role == "prefill")
    r = httpx.post(decode.url + "/v1/completions", json={"prompt": "hi"}, headers={"X-Tandem-Role": "router"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Tandem-Role"
    cluster.wait_idle()


class Load:
    """Clients sending greedy requests through `url` in a loop: each answer with its latency, and when it started."""

    def __init__(self, url: str, prompts: list[list[int]], clients: int = 3):
        self.url, self.prompts, self.stop = url, prompts, threading.Event()
        self.answers: list[tuple[float, float, int, list[int] | str]] = []  # (started, seconds, prompt, answer)
        self.threads = [threading.Thread(target=self._client, args=(k,)) for k in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, k: int) -> None:
        i = k
        while not self.stop.is_set():
            j, started = i % len(self.prompts), time.monotonic()
            try:
                answer: list[int] | str = ask(self.url, self.prompts[j], stream=i % 2 == 0)
            except (AssertionError, httpx.HTTPError) as e:
                answer = repr(e)
            self.answers.append((started, time.monotonic() - started, j, answer))
            i += 1

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def slowest(self, since: float = 0.0, until: float = float("inf")) -> float:
        return max(s for started, s, _, _ in self.answers if since <= started < until)


def test_a_decode_switched_through_its_own_endpoint_costs_its_requests_a_retry_not_a_stall(cluster, mono):
    """A router with a static worker list that reads /health once a minute: it learns each switch sent to the server
    itself from the server's refusal of a half meant for its old role (a decode half, then a prefill half), and moves
    the request at once; then the same switches through the router's own endpoint. Every answer equals the
    monolithic one, and none waits more than a few seconds longer than those before the first switch."""
    pairs = list(zip(cluster.prefills, cluster.prefill_bootstrap_ports))
    router = start_router(pairs, cluster.decodes, "--health-check-interval-s", "60", name="router-static")
    flipping = cluster.decodes[1]
    prompts = random_prompts(4, 8, 40, seed=8)
    expected = [generate(mono.url, p, NEW)["output_ids"] for p in prompts]
    load = Load(router.url, prompts)
    try:
        time.sleep(3)
        first_switch = time.monotonic()
        for role in ("prefill", "decode"):  # sent to the server itself: the router is not told
            r = httpx.post(flipping.url + "/pd_role_switch", json={"new_role": role}, timeout=400)
            assert r.status_code == 200 and r.json()["new_role"] == role, r.text
            wait_until(lambda role=role: roles(router.url)[flipping.url] == role, 10, f"the router to see {role}")
            time.sleep(2)  # the load runs on the new roles
        for role in ("prefill", "decode"):
            r = httpx.post(router.url + "/pd_role_switch", json={"url": flipping.url, "new_role": role}, timeout=400)
            assert r.status_code == 200 and r.json()["new_role"] == role, r.text
            assert roles(router.url)[flipping.url] == role
            time.sleep(2)
    finally:
        load.end()
        router_retries = metric(router.url, "tandem_router_retries_total")
        router.stop()
    failed = [(j, a) for _, _, j, a in load.answers if a != expected[j]]
    assert failed == [] and len(load.answers) >= 20, failed[:3]
    before = load.slowest(until=first_switch)
    assert load.slowest(since=first_switch) < before + 5, (before, sorted(s for _, s, _, _ in load.answers)[-5:])
    assert router_retries >= 2  # a decode half refused, then a prefill half
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
