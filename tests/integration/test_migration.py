"""Zero-loss PD (docs/migration.md), drilled on one 2P2D cluster of real processes: a decode killed
mid-stream, a flipped byte and a dropped write in a KV transfer (checksums on), a prefill killed while it
computes, and a rolling restart (a prefill, then a decode) under streams longer than the drain timeout.
Every request completes as the no-fault run of the same requests did (streamed: one stream, no delta repeated or missing;
n > 1, logprobs, usage), every surviving server ends with no KV page held; with no healthy pair left a
request still ends with a clear error within its bound. The second decode runs NGRAM speculation (it pairs
with the plain prefills): streams move from a speculating decode to a plain one and back, and still equal
the no-fault run token for token."""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, free_port, metric, record_fault
from tests.integration.cluster import spawn_router
from tests.integration.faults import wait_until
from tests.integration.kv_faults import arm, armed_still, site_env

pytestmark = pytest.mark.timeout(1200)  # four servers start first; a test restarts up to four of them
FLAGS = ("--page-size", "16", "--chunked-prefill-size", "64", "--max-total-tokens", "8192")
PD_FLAGS = (*FLAGS, "--disaggregation-enable-kv-checksum", "--drain-timeout-s", "2", "--heartbeat-interval-s", "1")
NGRAM = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4")
ROUTER_FLAGS = ("--health-check-interval-s", "0.3", "--health-check-timeout-s", "1", "--migration-limit", "3")
NEW = 40  # tokens per choice
STORY = "Tell me a long story about a dragon who learns to bake bread in a small village."
MESSAGES = [{"role": "user", "content": STORY}]
REQUESTS = {
    "generate n=2 seeded, logprobs": (
        "/generate",
        {
            "text": STORY,
            "stream": True,
            "return_logprob": True,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0.8, "seed": 11, "n": 2, "ignore_eos": True},
        },
    ),
    "chat seeded, logprobs, usage": (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": NEW,
            "temperature": 0.9,
            "seed": 5,
            "logprobs": True,
            "top_logprobs": 1,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "completions greedy, echo, logprobs": (
        "/v1/completions",
        {"prompt": STORY, "max_tokens": NEW, "temperature": 0, "logprobs": 1, "echo": True, "stream": True},
    ),
    "chat greedy n=2, stop string": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": NEW, "temperature": 0, "n": 2, "stop": ["bakery"], "stream": True},
    ),
    "responses seeded": (  # the router's translation goes on across the move: one numbering, one text
        "/v1/responses",
        {"input": STORY, "max_output_tokens": NEW, "temperature": 0.9, "seed": 5, "stream": True, "store": False},
    ),
    "generate JSON seeded": (
        "/generate",
        {"text": STORY, "sampling_params": {"max_new_tokens": NEW, "temperature": 1.0, "seed": 3, "ignore_eos": True}},
    ),
}


@dataclass
class Cluster:
    prefills: list[ServerProcess]
    decodes: list[ServerProcess]
    router: ServerProcess
    faults: list[str]  # each prefill's fault file (tests/integration/kv_faults.py)

    @property
    def servers(self) -> list[ServerProcess]:
        return self.prefills + self.decodes

    def healthy_in_router(self, server: ServerProcess) -> bool:
        workers = httpx.get(self.router.url + "/workers", timeout=5).json()["workers"]
        return any(w["url"] == server.url and w["healthy"] for w in workers)

    def restart(self, server: ServerProcess) -> None:
        server.restart().wait_ready()
        wait_until(lambda: self.healthy_in_router(server), 30, f"the router to use {server.name} again")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    faults = [str(tmp_path_factory.mktemp("kv-faults") / f"prefill{i}") for i in range(2)]
    for path in faults:
        Path(path).write_text("")
    servers: list[ServerProcess] = []
    try:
        for i in range(2):
            port, boot = free_port(), free_port()
            args = [
                "serve",
                "--port",
                str(port),
                "--disaggregation-mode",
                "prefill",
                "--bootstrap-port",
                str(boot),
                *PD_FLAGS,
            ]
            servers.append(ServerProcess(args, port, name=f"mig-prefill{i}", env=site_env(faults[i])))
        for j in range(2):
            port = free_port()
            args = ["serve", "--port", str(port), "--disaggregation-mode", "decode", *PD_FLAGS, *(NGRAM if j else ())]
            servers.append(ServerProcess(args, port, name=f"mig-decode{j}"))
        for s in servers:
            s.wait_ready(600)  # four servers load at once
        prefills, decodes = servers[:2], servers[2:]
        pairs = [(p, int(p.arg("--bootstrap-port"))) for p in prefills]
        router = spawn_router(pairs, decodes, *ROUTER_FLAGS, name="mig-router").wait_ready(60)
        servers.append(router)
        c = Cluster(prefills, decodes, router, faults)
        for s in c.servers:
            wait_until(lambda s=s: c.healthy_in_router(s), 30, f"the router to see {s.name}")
        yield c
    finally:
        for s in servers:
            s.stop()


# -- clients ----------------------------------------------------------------------------------------


@dataclass
class Answer:
    """What the client got: its events (streamed) or body (JSON), and how the stream ended."""

    status: int | None = None
    events: list[dict] = field(default_factory=list)
    body: dict | list | None = None
    done: bool = False
    error: str | None = None

    def view(self, path: str) -> dict:
        """What must equal the no-fault run's: per choice its text, tokens and logprobs as the client saw
        them, and the counts (ids, creation times and cache counters differ from run to run)."""
        if self.body is not None:
            return {"text": self.body["text"], "ids": self.body["output_ids"]}
        if path == "/generate":
            return {e["index"]: generate_view(e) for e in self.events}  # the last event of each choice
        if path == "/v1/responses":
            return responses_view(self.events)
        choices: dict[int, dict] = {}
        usage = None
        for e in self.events:
            usage = e.get("usage") or usage
            for c in e["choices"]:
                view = choices.setdefault(c["index"], {"text": "", "logprobs": [], "finish": None})
                view["text"] += c.get("delta", {}).get("content") or c.get("text") or ""
                view["logprobs"] += openai_logprobs(c.get("logprobs"))
                view["finish"] = c["finish_reason"] or view["finish"]
        if usage:
            choices["usage"] = {k: usage[k] for k in ("prompt_tokens", "completion_tokens")}
        return choices


def generate_view(event: dict) -> dict:
    meta = event["meta_info"]
    return {
        "text": event["text"],
        "ids": event["output_ids"],
        "logprobs": meta.get("output_token_logprobs"),
        "tops": meta.get("output_top_logprobs"),
        "finish": meta["finish_reason"],
        "completion_tokens": meta["completion_tokens"],
    }


def responses_view(events: list[dict]) -> dict:
    """A Responses stream: its sequence numbers without a gap, its deltas adding up to the final text."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["output"][-1]["content"][0]["text"]
    usage = final["usage"]
    return {"text": text, "status": final["status"], "tokens": (usage["input_tokens"], usage["output_tokens"])}


def openai_logprobs(logprobs: dict | None) -> list:
    if not logprobs:
        return []
    if "content" in logprobs:
        return [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]]) for e in logprobs["content"] or []]
    return list(zip(logprobs["tokens"], logprobs["token_logprobs"]))


class Client(threading.Thread):
    """One request on its own thread."""

    def __init__(self, url: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.answer = Answer()
        self.start()

    def run(self) -> None:
        a = self.answer
        try:
            if not self.body.get("stream"):
                r = httpx.post(self.url + self.path, json=self.body, timeout=300)
                a.status, a.body = r.status_code, r.json()
                return
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=300) as r:
                a.status = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        a.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            a.error = event["error"]["message"]
                        elif event.get("type") == "response.failed":
                            a.error = event["response"]["error"]["message"]
                        else:
                            a.events.append(event)
                            a.done = a.done or event.get("type") in ("response.completed", "response.incomplete")
        except httpx.HTTPError as e:
            a.error = f"transport: {e!r}"

    def tokens(self) -> int:
        """Tokens the client has of its first choice so far."""
        events = [e for e in list(self.answer.events) if e.get("index", 0) == 0]
        if self.path == "/generate":
            return len(events[-1]["output_ids"]) if events else 0
        if self.path == "/v1/responses":
            return sum(1 for e in list(self.answer.events) if e["type"] == "response.output_text.delta")
        return sum(
            1 for e in self.answer.events for c in e["choices"] if c.get("delta", {}).get("content") or c.get("text")
        )

    def result(self, timeout: float = 240) -> Answer:
        self.join(timeout)
        assert not self.is_alive(), f"{self.path} still running after {timeout} s"
        return self.answer


def started(clients: dict[str, Client], tokens: int) -> bool:
    """Every stream has `tokens` tokens of its first choice, or ended (a stop string may end one early)."""
    return all(c.tokens() >= tokens or c.answer.done for c in clients.values() if c.body.get("stream"))


def run_all(url: str) -> dict[str, Client]:
    return {name: Client(url, path, body) for name, (path, body) in REQUESTS.items()}


def check_continuous(name: str, answer: Answer) -> None:
    """One stream, no delta repeated or missing: /generate's cumulative events grow by one token each (the
    last, the finish, repeats the whole output)."""
    assert answer.status == 200 and answer.error is None, (name, answer.status, answer.error)
    if answer.body is not None:
        return
    assert answer.done, name
    if REQUESTS[name][0] == "/generate":
        for index in {e["index"] for e in answer.events}:
            lengths = [len(e["output_ids"]) for e in answer.events if e["index"] == index]
            assert lengths in (list(range(1, NEW + 1)), [*range(1, NEW + 1), NEW]), (name, index, lengths)


@pytest.fixture(scope="module")
def no_fault(cluster) -> dict[str, dict]:
    """Every request's answer without a fault, as the client saw it."""
    clients = run_all(cluster.router.url)
    answers = {name: c.result() for name, c in clients.items()}
    for name, a in answers.items():
        check_continuous(name, a)
    assert metric(cluster.decodes[1].url, "tandem_spec_verify_total") > 0  # the NGRAM decode took a share
    return {name: a.view(REQUESTS[name][0]) for name, a in answers.items()}


def same(a, b) -> bool:
    """Equal, logprobs within 1e-4: tokens after a move run in another batch on another decode, whose float
    sums may differ in the last bits (the tokens and the text do not)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_as_without_faults(clients: dict[str, Client], no_fault: dict[str, dict]) -> None:
    for name, client in clients.items():
        answer = client.result()
        check_continuous(name, answer)
        assert same(answer.view(client.path), no_fault[name]), (name, answer.view(client.path), no_fault[name])


def migrations(cluster: Cluster, reason: str) -> float:
    return metric(cluster.router.url, "tandem_router_migrations_total", reason=reason)


def idle(servers: list[ServerProcess]) -> None:
    for s in servers:
        s.wait_idle()


def busiest(servers: list[ServerProcess]) -> ServerProcess:
    return max(servers, key=lambda s: s.info()["num_running_reqs"])


# -- the drills -------------------------------------------------------------------------------------


def test_streams_go_on_exactly_when_their_decode_is_killed(cluster, no_fault):
    before = migrations(cluster, "decode_failed")
    clients = run_all(cluster.router.url)
    wait_until(lambda: started(clients, 8), 120, "8 tokens each")
    victim = busiest(cluster.decodes)
    killed_at = time.monotonic()
    victim.signal(signal.SIGKILL)
    assert_as_without_faults(clients, no_fault)
    assert migrations(cluster, "decode_failed") > before
    idle([s for s in cluster.servers if s is not victim])
    record_fault("decode killed mid-stream (2P2D)", "every stream complete, as without the fault", None, 0, None)
    cluster.restart(victim)
    assert time.monotonic() - killed_at < 300


@pytest.mark.parametrize("fault", ["flip", "drop"])
def test_a_corrupted_transfer_is_caught_and_the_request_moves(cluster, fault):
    """prefill0's next KV write after the test arms it flips a byte or is dropped; requests of a prompt no
    cache holds (so the dropped pages' stale bytes differ) go one at a time, the router's round robin
    alternating the prefills, until one met the fault: the decode's checksum catches it, the request moves
    and its answer equals the same request's without a fault."""
    failures = sum(metric(d.url, "tandem_kv_transfer_failures_total", cause="checksum") for d in cluster.decodes)
    path, body = REQUESTS["generate n=2 seeded, logprobs"]
    arm(cluster.faults[0], fault)
    for i in range(4):
        unique = body | {"text": f"{fault} {i} {time.time()}: {STORY}"}
        faulted = Client(cluster.router.url, path, unique).result()
        if not armed_still(cluster.faults[0]):
            break
    assert not armed_still(cluster.faults[0]), "no KV write of prefill0 happened"
    clean = Client(cluster.router.url, path, unique).result()
    for answer in (faulted, clean):
        check_continuous("generate n=2 seeded, logprobs", answer)
    assert same(faulted.view(path), clean.view(path))
    after = sum(metric(d.url, "tandem_kv_transfer_failures_total", cause="checksum") for d in cluster.decodes)
    assert after == failures + 1
    idle(cluster.servers)
    what = "a flipped byte" if fault == "flip" else "a dropped write"
    record_fault(f"{what} in a KV transfer (checksums on)", "caught; the request moved, exact", None, 0, None)


def test_requests_go_on_exactly_when_a_prefill_dies_before_its_kv_lands(cluster, no_fault):
    """prefill0 frozen, the requests the router's round robin gives it wait there; it is killed before the
    health checks notice (their KV never lands) and they move to prefill1."""
    victim = cluster.prefills[0]
    victim.signal(signal.SIGSTOP)
    clients = run_all(cluster.router.url)
    time.sleep(0.5)
    victim.signal(signal.SIGKILL)
    assert_as_without_faults(clients, no_fault)
    idle([s for s in cluster.servers if s is not victim])
    record_fault("prefill killed before its KV landed", "every request complete, as without the fault", None, 0, None)
    cluster.restart(victim)


def test_a_rolling_restart_under_long_streams_loses_nothing(cluster, no_fault):
    """A prefill, then the speculating decode, get SIGTERM while streams run that are longer than their drain
    timeout (2 s): the decode hands its streams to the router at once and exits within seconds, the prefill
    finishes its transfers; each comes back before the next goes (the other two run the same code: one of each
    kind keeps the drill to two restarts)."""
    for server in (cluster.prefills[0], cluster.decodes[1]):
        clients = run_all(cluster.router.url)
        wait_until(lambda: started(clients, 4), 120, "streams")
        sent = time.monotonic()
        server.signal(signal.SIGTERM)
        assert server.proc.wait(15) == 0
        exit_s = time.monotonic() - sent
        assert_as_without_faults(clients, no_fault)
        record_fault(f"rolling restart: SIGTERM to {server.name}", "every stream complete, exact", exit_s, 0, None)
        cluster.restart(server)
    idle(cluster.servers)


def test_with_no_healthy_pair_left_a_stream_ends_with_a_clear_error_in_bound(cluster):
    """A router over one prefill and one decode: the decode frozen mid-stream is taken out of rotation by the
    health checks, the stream cannot move, and it ends with an error event naming the decode."""
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    router = spawn_router([(prefill, int(prefill.arg("--bootstrap-port")))], [decode], *ROUTER_FLAGS, name="mig-1p1d")
    try:
        router.wait_ready(60)
        path, body = REQUESTS["chat seeded, logprobs, usage"]
        client = Client(router.url, path, body | {"max_tokens": 400})
        wait_until(lambda: client.tokens() >= 4, 120, "tokens")
        frozen_at = time.monotonic()
        decode.signal(signal.SIGSTOP)
        try:
            answer = client.result(60)
            took = time.monotonic() - frozen_at
        finally:
            decode.signal(signal.SIGCONT)
        assert answer.done and answer.error and decode.url in answer.error, answer.error
        assert took < 5, took
        record_fault("decode frozen, no other pair (1P1D router)", "stream ends: error event naming it", took, 0, None)
    finally:
        router.stop()
    idle(cluster.servers)
