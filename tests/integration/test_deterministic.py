"""--enable-deterministic-inference as users drive it (the built-in model, real processes, real HTTP, Mooncake
TCP on 127.0.0.1): the same 16 prompts (half greedy, half seeded; logprobs and top-2 logprobs on) give the
same tokens and the same logprob bits alone on a monolithic server (prompts in one chunk of 4096), in
batches of 8 and 32 among other random requests, from the prefix cache, through 1P1D and 2P2D (prefills in
chunks of 64; one decode runs NGRAM speculation) and with a decode killed mid-stream (the stream moves to the
other decode). An FP8 cache answers the same alone and in a batch. One server or cluster per configuration,
shared by the module."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import ServerProcess, free_port, metric, start_server
from tests.integration.cluster import Cluster, start_router
from tests.integration.test_migration import Client, generate_view

pytestmark = pytest.mark.timeout(900)
DET = ("--enable-deterministic-inference", "--page-size", "16", "--max-total-tokens", "6144")
PD = ("--chunked-prefill-size", "64", "--drain-timeout-s", "2", "--heartbeat-interval-s", "1")
NGRAM = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4")
MODE = ("--disaggregation-mode",)
ROUTER = ("--health-check-interval-s", "0.3", "--health-check-timeout-s", "1", "--migration-limit", "3")
NEW = 24
VOCAB = 49152
rng = random.Random(55)
PROMPTS = [[rng.randrange(VOCAB) for _ in range(n)] for n in [*rng.sample(range(5, 200), 14), 270, 300]]


def body(i: int, prompt: list[int], new: int = NEW, seeded: bool | None = None) -> dict:
    seeded = i % 2 == 1 if seeded is None else seeded
    sampling = {"temperature": 0.9, "top_k": 20, "seed": 7 + i} if seeded else {"temperature": 0}
    return {
        "input_ids": prompt,
        "stream": True,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": new, "ignore_eos": True, **sampling},
    }


TARGETS = [body(i, p) for i, p in enumerate(PROMPTS)]


def others(n: int, seed: int) -> list[dict]:
    """Random requests around the targets: prompts of 1 to 300 tokens, 1 to NEW tokens, greedy or unseeded."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        b = body(0, [r.randrange(VOCAB) for _ in range(r.randint(1, 300))], r.randint(1, NEW), seeded=False)
        b["sampling_params"]["temperature"] = r.choice([0, 1.0])
        out.append(b)
    return out


def answers(url: str, bodies: list[dict], concurrency: int = 1, seed: int = 0, kept: int | None = None) -> list[dict]:
    """The answers (tokens, text, logprobs, top logprobs) of the first `kept` bodies (default all), every
    body sent in a shuffled order, `concurrency` at a time."""
    order = list(range(len(bodies)))
    random.Random(seed).shuffle(order)

    def one(b: dict) -> dict:
        a = Client(url, "/generate", b).result()
        assert a.status == 200 and a.error is None and a.done, (a.status, a.error)
        return generate_view(a.events[-1])

    with ThreadPoolExecutor(concurrency) as pool:
        got = dict(zip(order, pool.map(one, [bodies[i] for i in order])))
    return [got[i] for i in range(len(bodies) if kept is None else kept)]


def crowded(url: str, extra: int, concurrency: int, seed: int) -> list[dict]:
    return answers(url, TARGETS + others(extra, seed), concurrency, seed, kept=len(TARGETS))


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    """Everything the module needs, started at once: a monolithic server, one with an FP8 cache, and two
    prefills and two decodes (the second speculates: NGRAM pairs with plain prefills)."""
    started: dict[str, ServerProcess] = {}
    try:
        started["mono"] = start_server(*DET, "--chunked-prefill-size", "4096", name="det-mono")
        started["fp8"] = start_server(*DET, "--kv-cache-dtype", "fp8_e4m3", name="det-fp8")
        for i in range(2):
            boot = ("--bootstrap-port", str(free_port()))
            started[f"prefill{i}"] = start_server(*MODE, "prefill", *boot, *DET, *PD, name=f"det-prefill{i}")
        for j in range(2):
            started[f"decode{j}"] = start_server(
                *MODE, "decode", *DET, *PD, *(NGRAM if j else ()), name=f"det-decode{j}"
            )
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def mono(servers) -> ServerProcess:
    return servers["mono"].wait_ready()


@pytest.fixture(scope="module")
def alone(mono) -> list[dict]:
    """The first answers: each target alone on the monolithic server, nothing cached yet."""
    return [answers(mono.url, [t])[0] for t in TARGETS]


def cached_tokens(url: str, b: dict) -> int:
    a = Client(url, "/generate", b).result()
    return a.events[-1]["meta_info"]["cached_tokens"]


def test_alone_in_batches_of_8_and_32_and_from_the_prefix_cache(mono, alone):
    assert crowded(mono.url, 8, 8, seed=1) == alone
    assert crowded(mono.url, 32, 32, seed=2) == alone
    assert cached_tokens(mono.url, TARGETS[-1]) >= 256  # every prompt is cached by now
    assert answers(mono.url, TARGETS, 4, seed=3) == alone


def test_an_fp8_cache_answers_the_same_alone_and_in_a_batch(servers):
    fp8 = servers["fp8"].wait_ready()
    first = [answers(fp8.url, [t])[0] for t in TARGETS]
    assert crowded(fp8.url, 32, 32, seed=4) == first


@pytest.fixture(scope="module")
def routers(servers) -> Iterator[dict[str, ServerProcess]]:
    """1P1D (prefill0, decode0) and 2P2D, two routers over the same four servers."""
    nodes = [servers[n].wait_ready() for n in ("prefill0", "prefill1", "decode0", "decode1")]
    pairs = [(p, int(p.arg("--bootstrap-port"))) for p in nodes[:2]]
    started = {}
    try:
        started["1p1d"] = start_router(pairs[:1], nodes[2:3], *ROUTER, name="det-router-1p1d")
        started["2p2d"] = start_router(pairs, nodes[2:], *ROUTER, name="det-router-2p2d")
        Cluster(nodes[:2], nodes[2:], started["2p2d"]).wait_all_healthy(60)
        yield started
    finally:
        for s in started.values():
            s.stop()


def test_through_1p1d_and_2p2d_with_ngram_speculation(servers, routers, alone):
    assert crowded(routers["1p1d"].url, 8, 8, seed=5) == alone
    assert crowded(routers["2p2d"].url, 32, 32, seed=6) == alone
    assert metric(servers["decode1"].url, "tandem_spec_verify_total") > 0  # the NGRAM decode took a share


def test_a_decode_killed_mid_stream_moves_and_answers_the_same(servers, routers, alone):
    """Every target streamed through 2P2D at once; the decode with the most requests is killed once they
    have a few tokens: its streams move to the other decode and end with the same bits."""
    url = routers["2p2d"].url
    clients = [Client(url, "/generate", t) for t in TARGETS]
    deadline = time.monotonic() + 120
    while not all(c.tokens() >= 3 or c.answer.done for c in clients):
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.05)
    decodes = [servers["decode0"], servers["decode1"]]
    victim = max(decodes, key=lambda d: d.info()["num_running_reqs"])
    victim.signal(signal.SIGKILL)
    got = []
    for c in clients:
        a = c.result()
        assert a.status == 200 and a.error is None and a.done, (a.status, a.error)
        got.append(generate_view(a.events[-1]))
    assert got == alone
    moved = sum(metric(url, "tandem_router_migrations_total", reason=r) for r in ("decode_failed", "worker_dead"))
    assert moved > 0
