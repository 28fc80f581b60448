"""`--policy kv_aware` over 2 prefills and 2 decodes that publish KV cache events, behind two router processes:
greedy output equals the monolithic server's, a conversation's later turns land where its pages are (the
prefill's cached tokens, and the decode pages the router's index matched), each router process's index equals
what every worker really holds, and a restarted worker's pages are forgotten and relearned. A third router picks
only the decode by kv_aware (`--decode-policy kv_aware`). Last, PD at scale on the same four workers: 32
requests in flight at once equal monolithic; and a decode of another page size refuses their prefill, naming
both values."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import start_server
from tests.integration.cluster import generate, start_cluster, start_router
from tests.integration.test_pd import expected, prompts  # noqa: F401  (module fixtures, over this module's mono)

PAGE = 16
EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
FLAGS = ("--page-size", str(PAGE), "--chunked-prefill-size", "64", "--kv-events-config", EVENTS)
pytestmark = pytest.mark.timeout(1200)  # four servers of the built-in model (and the shared reference) start first
CONVERSATIONS, FIRST_LEN, TURN_LEN, NEW_TOKENS = 4, 120, 24, 8


@pytest.fixture(scope="module")
def cluster(mono):  # after the monolithic server is up: five servers starting at once are slow on a small machine
    c = start_cluster(
        "mooncake",
        n_prefill=2,
        n_decode=2,
        flags=FLAGS,
        policy="kv_aware",
        router_flags=("--processes", "2", "--kv-load-tokens", "16"),
        ready_timeout=600,
    )
    yield c
    c.stop()


@pytest.fixture(scope="module", autouse=True)
def decode_kv_router(cluster):
    """`--policy round_robin --decode-policy kv_aware` over the same workers, started before any page is cached:
    its index is exact too."""
    pairs = list(zip(cluster.prefills, cluster.prefill_bootstrap_ports))
    flags = ("--decode-policy", "kv_aware", "--kv-load-tokens", "16", "--health-check-interval-s", "0.5")
    router = start_router(pairs, cluster.decodes, *flags, policy="round_robin", name="router-kv-decode")
    yield router
    router.stop()


@pytest.fixture(scope="module")
def mono(reference_servers):
    return reference_servers.get("--page-size", str(PAGE), "--chunked-prefill-size", "64")  # test_pd.py's


def router_samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def index_matches_workers(cluster, url: str, processes: int) -> str:
    """'' when every router process's index (of the router at `url`) holds exactly each worker's cached pages,
    else what differs."""
    pages = router_samples(url, "tandem_router_kv_index_pages")
    for node in cluster.nodes:
        real = node.info()["kv_pages"]["cached"]
        seen = [v for labels, v in pages if labels["worker"] == node.url]
        if len(seen) != processes or any(v != real for v in seen):
            return f"{node.name} holds {real} cached pages; the router processes' indexes say {seen}"
    return ""


def wait_index(cluster, timeout: float = 20, url: str | None = None, processes: int = 2) -> None:
    deadline, why = time.monotonic() + timeout, "never checked"
    while time.monotonic() < deadline:
        cluster.wait_idle()
        why = index_matches_workers(cluster, url or cluster.url, processes)
        if not why:
            return
        time.sleep(0.3)
    raise AssertionError(why)


def converse(
    url: str, seed: int, turns: int, history: list[int] | None = None, barrier: threading.Barrier | None = None
) -> list[tuple[list[int], dict]]:
    """One conversation: each turn's prompt is the last prompt, its answer and new tokens; with a barrier, the
    conversations take their turns together (its action lets the router's index catch up between turns)."""
    rng, out = random.Random(seed), []
    prompt = history or []
    for _ in range(turns):
        prompt = prompt + [rng.randrange(100, 20000) for _ in range(TURN_LEN if prompt else FIRST_LEN)]
        answer = generate(url, prompt, NEW_TOKENS)
        out.append((prompt, answer))
        prompt = prompt + answer["output_ids"]
        if barrier is not None:
            barrier.wait()
    return out


def check_turns(convs: list[list[tuple[list[int], dict]]], mono) -> int:
    """Asserts greedy output equals monolithic and every later turn hit its prefill's cache; returns the
    prompt tokens of earlier turns a decode could have kept (whole pages)."""
    decode_pages = 0
    for conv in convs:
        for k, (prompt, answer) in enumerate(conv):
            assert answer["output_ids"] == generate(mono.url, prompt, NEW_TOKENS)["output_ids"]
            if k:
                earlier = conv[k - 1][0]
                assert answer["meta_info"]["cached_tokens"] >= len(earlier) // PAGE * PAGE, f"turn {k} missed"
                decode_pages += len(earlier) // PAGE * PAGE
    return decode_pages


def test_turns_land_where_their_pages_are_and_equal_monolithic(cluster, mono):
    wait_index(cluster)
    turns_taken = threading.Barrier(CONVERSATIONS, action=lambda: wait_index(cluster))  # events arrive async
    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        convs = list(pool.map(lambda i: converse(cluster.url, i, 3, barrier=turns_taken), range(CONVERSATIONS)))
    kept = check_turns(convs, mono)
    matched = {
        labels["worker_role"]: v for labels, v in router_samples(cluster.url, "tandem_router_kv_matched_tokens_total")
    }
    assert matched["decode"] >= kept  # the decode chosen held at least the earlier turns' prompt pages
    assert matched["prefill"] >= kept
    wait_index(cluster)


def test_a_restarted_worker_is_forgotten_and_relearned(cluster, mono):
    wait_index(cluster)
    first = converse(cluster.url, 100, 1)
    prefill = cluster.prefills[0]
    prefill.restart().wait_ready()
    wait_index(cluster, 30)  # its old pages are gone from both indexes
    prompt, answer = first[0]
    later = converse(cluster.url, 101, 2, prompt + answer["output_ids"])
    for p, a in later:
        assert a["output_ids"] == generate(mono.url, p, NEW_TOKENS)["output_ids"]
    wait_index(cluster)


def test_decode_policy_kv_aware_sends_each_turn_to_the_decode_that_holds_the_last(cluster, mono, decode_kv_router):
    """The decodes in turn would send every other turn to the decode without the conversation; kv_aware's
    decode half sends each to the one that holds it."""
    url = decode_kv_router.url
    wait_index(cluster, url=url, processes=1)
    prompt, kept = [], 0
    for turn in range(3):
        new = TURN_LEN if prompt else FIRST_LEN
        prompt = prompt + [random.Random(300 + turn).randrange(100, 20000) for _ in range(new)]
        answer = generate(url, prompt, NEW_TOKENS)
        assert answer["output_ids"] == generate(mono.url, prompt, NEW_TOKENS)["output_ids"]
        kept += len(prompt) // PAGE * PAGE if turn < 2 else 0  # what the next turn's decode holds
        prompt = prompt + answer["output_ids"]
        wait_index(cluster, url=url, processes=1)
    matched = {labels["worker_role"]: v for labels, v in router_samples(url, "tandem_router_kv_matched_tokens_total")}
    assert matched["decode"] >= kept


def test_32_concurrent_requests_over_two_prefills_and_two_decodes_equal_monolithic(cluster, prompts, expected):
    jobs = [i % len(prompts) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: generate(cluster.url, prompts[i])["output_ids"], jobs))
    assert results == [expected[i] for i in jobs]
    assert all(node.info()["kv_pages"]["total"] > 0 for node in cluster.nodes)
    cluster.wait_idle()


def test_a_decode_of_another_page_size_refuses_the_prefill_naming_both(cluster, prompts):
    decode = start_server(
        "--disaggregation-mode", "decode", "--transfer-backend", "mooncake", "--page-size", "8", name="d-page8"
    )
    router = None
    try:
        router = start_router([(cluster.prefills[0], cluster.prefill_bootstrap_ports[0])], [decode.wait_ready()])
        body = {"input_ids": prompts[3], "sampling_params": {"max_new_tokens": 4}}
        r = httpx.post(router.url + "/generate", json=body, timeout=120)
        assert r.status_code == 502, r.text
        assert "page_size: decode has 8, prefill has 16" in r.json()["error"]["message"]
        decode.wait_idle()
        cluster.wait_idle()
    finally:
        for server in (router, decode):
            if server is not None:
                server.stop()
