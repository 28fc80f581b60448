"""Overload with real processes (tiny model): decode memory pressure makes prefill wait, not fail,
until the configured timeout; beyond the bounded queues clients get 503 with Retry-After; nothing
leaks either way."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.conftest import ServerProcess, free_port, start_server
from tests.integration.cluster import generate, spawn_router
from tests.integration.faults import wait_until
from tests.integration.tiny_model import random_prompts

ENGINE = ("--page-size", "16", "--chunked-prefill-size", "256")
# 64 pages of 16 tokens: one 950-token prompt (plus its decode reserve) fills a decode.
SMALL_DECODE = ("--max-total-tokens", "1024")
BIG_PROMPTS = random_prompts(6, 950, 950, seed=3)
NEW = 40


class Setup:
    """One prefill (queue bound 12) and two small decodes, one of which waits at most 0.3 s for
    memory; one router per decode; and the monolithic server that gives the expected tokens (stopped once
    it gave them), all started at once."""

    def __init__(self, model: str):
        common = ("--model", model, "--transfer-backend", "mooncake", *ENGINE)
        self.mono = start_server("--model", model, *ENGINE, name="ov-mono")
        self.prefill = start_server(
            "--disaggregation-mode",
            "prefill",
            "--bootstrap-port",
            str(free_port()),
            "--max-queued-requests",
            "12",
            *common,
            name="ov-prefill",
        )
        self.patient = start_server("--disaggregation-mode", "decode", *common, *SMALL_DECODE, name="ov-decode-patient")
        self.hasty = start_server(
            "--disaggregation-mode",
            "decode",
            *common,
            *SMALL_DECODE,
            "--pairing-timeout-s",
            "0.3",
            name="ov-decode-hasty",
        )
        for n in self.nodes:
            n.wait_ready()
        self.to_patient, self.to_hasty = (self._router(d) for d in (self.patient, self.hasty))
        for r in (self.to_patient, self.to_hasty):
            r.wait_ready(60)

    def _router(self, decode: ServerProcess) -> ServerProcess:
        prefill = (self.prefill, int(self.prefill.arg("--bootstrap-port")))
        # --migration-limit 0: the client sees the servers' own answers (a move would retry a 504 elsewhere)
        return spawn_router([prefill], [decode], "--migration-limit", "0", name=f"ov-router-{decode.name}")

    @property
    def nodes(self) -> list[ServerProcess]:
        return [self.prefill, self.patient, self.hasty]

    def stop(self) -> None:
        for p in [self.to_patient, self.to_hasty, *self.nodes, self.mono]:
            p.stop()


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    s = Setup(str(tiny_model_dir))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(setup) -> list[list[int]]:
    mono = setup.mono.wait_ready()
    try:
        return [generate(mono.url, p, NEW, sampling={"ignore_eos": True})["output_ids"] for p in BIG_PROMPTS]
    finally:
        mono.stop()


@pytest.fixture(autouse=True)
def idle_after(setup):
    yield
    for node in setup.nodes:
        node.wait_idle()


def post(url: str, ids: list[int]) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}
    return httpx.post(url + "/generate", json=body, timeout=120)


def test_decode_memory_pressure_makes_prefill_wait_not_fail(setup, expected):
    seen = {"prealloc": 0, "awaiting_decode": 0}

    def watch() -> bool:
        seen["prealloc"] = max(seen["prealloc"], setup.patient.info()["role"]["prealloc"])
        seen["awaiting_decode"] = max(seen["awaiting_decode"], setup.prefill.info()["role"]["awaiting_decode"])
        return seen["prealloc"] >= 2

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, setup.to_patient.url, ids) for ids in BIG_PROMPTS[:4]]
        wait_until(watch, 60, "requests to queue for decode memory")
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200] * 4
    assert [r.json()["output_ids"] for r in results] == expected[:4]
    assert seen["awaiting_decode"] >= 2  # the prefill held them, without computing, until decode had room


def test_waiting_for_decode_memory_ends_at_the_configured_timeout(setup, expected):
    prompts = BIG_PROMPTS * 2
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda ids: post(setup.to_hasty.url, ids), prompts))
    codes = [r.status_code for r in results]
    assert 200 in codes and 504 in codes, codes
    for r in results:
        if r.status_code == 504:
            assert "could not reserve memory or reach the prefill peer within 0.3 s" in r.json()["error"]["message"]
    for r, want in zip(results, expected * 2):
        assert r.status_code in (200, 504), r.text
        if r.status_code == 200:
            assert r.json()["output_ids"] == want


def test_full_queues_answer_503_with_retry_after(setup, expected):
    ids = BIG_PROMPTS[0]
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(lambda _: post(setup.to_patient.url, ids), range(24)))
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 503}, codes
    for r in results:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "overloaded_error"
        else:
            assert r.json()["output_ids"] == expected[0]
