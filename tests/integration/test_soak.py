"""Soak, per transfer backend: requests through a 2 prefill + 2 decode cluster (tiny model), streaming
and not, with random client aborts and one prefill SIGKILLed and restarted in the middle. Zero hung
requests, zero leaked pages, and every request that succeeded is token-identical to the monolithic
server. The long run (200 requests) is Mooncake's; NIXL's run is the same test at 100 requests (the
same faults: aborts throughout, the restart at the middle), half the suite time for the second backend."""

from __future__ import annotations

import concurrent.futures
import json
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

from tests.conftest import record_fault
from tests.integration.cluster import generate, start_cluster
from tests.integration.faults import router_sees, wait_until
from tests.integration.tiny_model import random_prompts

ENGINE = ("--page-size", "4", "--chunked-prefill-size", "32")
FAULTS = ("--heartbeat-interval-s", "0.5", "--heartbeat-misses", "3", "--transfer-timeout-s", "5")
ROUTER = ("--health-check-timeout-s", "1", "--health-failure-threshold", "2")
REQUESTS = {"mooncake": 200, "nixl": 100}
CONCURRENCY, ABORT_RATE = 12, 0.15
PROMPTS = random_prompts(40, 4, 120, seed=11)
NEW_TOKENS = (4, 8, 16)
CLIENT_TIMEOUT_S = 60.0  # a request still running after this is a hang


@dataclass
class Job:
    index: int
    prompt: int
    new: int
    stream: bool
    abort_after_s: float | None  # the client goes away after this long


@dataclass
class Result:
    kind: str  # ok | error | aborted | hung
    output_ids: list[int] | None = None
    detail: str = ""
    at: float = 0.0


def make_jobs(n: int) -> list[Job]:
    rng = random.Random(5)
    return [
        Job(
            i,
            rng.randrange(len(PROMPTS)),
            rng.choice(NEW_TOKENS),
            rng.random() < 0.5,
            rng.uniform(0.0, 0.3) if rng.random() < ABORT_RATE else None,
        )
        for i in range(n)
    ]


def run(url: str, job: Job) -> Result:
    body = {
        "input_ids": PROMPTS[job.prompt],
        "stream": job.stream,
        "sampling_params": {"max_new_tokens": job.new, "temperature": 0, "ignore_eos": True},
    }
    timeout = job.abort_after_s if job.abort_after_s is not None else CLIENT_TIMEOUT_S
    try:
        result = (_stream if job.stream else _post)(url, body, timeout)
    except httpx.TimeoutException:
        result = Result("aborted" if job.abort_after_s is not None else "hung")
    except httpx.HTTPError as e:
        result = Result("error", detail=f"transport: {e!r}")
    result.at = time.monotonic()
    return result


def _post(url: str, body: dict, timeout: float) -> Result:
    r = httpx.post(url + "/generate", json=body, timeout=timeout)
    if r.status_code == 200:
        return Result("ok", r.json()["output_ids"])
    return Result("error", detail=f"{r.status_code} {r.json()['error']['message']}")


def _stream(url: str, body: dict, timeout: float) -> Result:
    last, done = None, False
    with httpx.stream("POST", url + "/generate", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return Result("error", detail=f"{r.status_code} {r.read().decode()[:200]}")
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return Result("error", detail=f"stream error: {event['error']['message']}")
                last = event
    if not done or last is None:
        return Result("error", detail="stream ended without [DONE]")
    return Result("ok", last["output_ids"])


@pytest.fixture(scope="module")
def expected(tiny_model_dir, reference_servers) -> dict[tuple[int, int], list[int]]:
    """Greedy, so a shorter answer is the longest one's prefix: one request per prompt."""
    mono = reference_servers.get("--model", str(tiny_model_dir), *ENGINE)  # test_pd_api_fields.py's
    longest = [generate(mono.url, ids, max(NEW_TOKENS), sampling={"ignore_eos": True})["output_ids"] for ids in PROMPTS]
    return {(p, n): longest[p][:n] for p in range(len(PROMPTS)) for n in NEW_TOKENS}


@pytest.mark.parametrize("backend", list(REQUESTS))
def test_soak_with_random_aborts_and_a_prefill_restart(tiny_model_dir, expected, backend):
    c = start_cluster(
        backend, n_prefill=2, n_decode=2, flags=("--model", str(tiny_model_dir), *ENGINE, *FAULTS), router_flags=ROUTER
    )
    try:
        n = REQUESTS[backend]
        jobs = make_jobs(n)
        window: dict[str, float] = {}
        restart_at = threading.Event()

        def restart_prefill() -> None:
            restart_at.wait(300)
            victim = c.prefills[0]
            window["kill"] = time.monotonic()
            victim.signal(signal.SIGKILL)
            victim.restart().wait_ready()
            wait_until(lambda: router_sees(c.url, victim, healthy=True), 30, "the router to use the restarted prefill")
            window["back"] = time.monotonic()

        restarter = threading.Thread(target=restart_prefill, daemon=True)
        restarter.start()

        def run_job(job: Job) -> Result:
            if job.index == n // 2:
                restart_at.set()
            return run(c.url, job)

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(run_job, jobs))
        elapsed = time.monotonic() - t0
        restarter.join(60)
        assert "back" in window, "the restarted prefill never came back"

        kinds = Counter(r.kind for r in results)
        assert kinds["hung"] == 0, kinds
        wrong = [
            (j.index, r.output_ids, expected[(j.prompt, j.new)])
            for j, r in zip(jobs, results)
            if r.kind == "ok" and r.output_ids != expected[(j.prompt, j.new)]
        ]
        assert wrong == [], wrong[:3]
        errors = [(j.index, r.detail, r.at) for j, r in zip(jobs, results) if r.kind == "error"]
        outside = [e for e in errors if not window["kill"] - 1 <= e[2] <= window["back"] + 5]
        assert outside == [], outside  # errors only while a prefill was down
        assert kinds["ok"] >= n * 0.6, kinds
        for node in c.nodes:
            node.wait_idle()  # integrity of every pool, and no page held by anyone
        print(f"\nsoak: {dict(kinds)} in {elapsed:.1f} s; errors during the restart: {len(errors)}")
        record_fault(
            f"soak ({backend}): {n} requests, 15% client aborts, prefill restart",
            f"{kinds['ok']} ok, {kinds['aborted']} aborted, {len(errors)} errors (all during the restart), 0 hung",
            None,
            0,
            window["back"] - window["kill"],
        )
    finally:
        c.stop()
