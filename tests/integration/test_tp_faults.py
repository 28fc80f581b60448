"""Rank faults of a tensor-parallel server (tiny Llama, TP 2): a follower that hangs or dies turns /health
into a 503 naming it within the watchdog window and ends the requests in flight with an error naming it;
no rank outlives its server (rank 0's death ends the followers; SIGTERM drains every rank); a --tp-size
that cannot split the model fails at start-up naming the flag and the sizes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import ServerProcess, free_port, record_fault, start_server
from tests.integration.tiny_model import save_tiny_llama

WATCHDOG_S = 3.0
LONG = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-tp"), heads=8, kv_heads=4)


@pytest.fixture(scope="module")
def servers(model_dir):
    """Four TP 2 servers started together (one per fault: each fault ends its server's group)."""
    flags = ("--model", str(model_dir), "--tp-size", "2", "--watchdog-timeout-s", str(WATCHDOG_S))
    started = {name: start_server(*flags, name=f"tp-{name}") for name in ("hang", "kill", "rank0", "drain")}
    try:
        yield {name: s.wait_ready(400) for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def follower_pids(server) -> list[int]:
    return [r["pid"] for r in server.info()["tp"]["ranks"][1:]]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout[:1] != "Z"


def wait_gone(pids: list[int], timeout: float) -> float:
    t0 = time.monotonic()
    while any(alive(p) for p in pids):
        assert time.monotonic() - t0 < timeout, f"rank processes {[p for p in pids if alive(p)]} outlived their server"
        time.sleep(0.1)
    return time.monotonic() - t0


def in_flight(pool: ThreadPoolExecutor, server, body: dict = LONG) -> Future:
    """A long request, started and decoding when this returns."""
    before = server.info()["kv_pages"]["in_use"]
    fut = pool.submit(lambda: httpx.post(server.url + "/generate", json=body, timeout=120))
    deadline = time.monotonic() + 30
    while server.info()["kv_pages"]["in_use"] == before:
        assert time.monotonic() < deadline and not fut.done(), "the request never started"
        time.sleep(0.05)
    return fut


def sigterm_with_a_request_in_flight(server, tokens: int) -> None:
    """SIGTERM `server` while a request of `tokens` tokens runs: it finishes whole, then the server exits 0."""
    body = LONG | {"sampling_params": LONG["sampling_params"] | {"max_new_tokens": tokens}}
    with ThreadPoolExecutor(1) as pool:
        fut = in_flight(pool, server, body)
        server.proc.send_signal(signal.SIGTERM)
        r = fut.result()
    assert r.status_code == 200 and len(r.json()["output_ids"]) == tokens, r.text
    assert server.proc.wait(30) == 0


@pytest.mark.parametrize(("name", "sig"), [("hang", signal.SIGSTOP), ("kill", signal.SIGKILL)])
def test_follower_fault_is_named(servers, name, sig):
    server = servers[name]
    pids = follower_pids(server)
    with ThreadPoolExecutor(1) as pool:
        fut = in_flight(pool, server)
        t0 = time.monotonic()
        os.kill(pids[0], sig)
        r = fut.result()
        t_error = time.monotonic() - t0
    assert r.status_code == 500 and f"tp rank 1 (pid {pids[0]}" in r.json()["error"]["message"], r.text
    assert t_error < WATCHDOG_S + 3 if sig == signal.SIGSTOP else t_error < 3
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 503 and f"tp rank 1 (pid {pids[0]}" in health.json()["error"]["message"]
    later = httpx.post(server.url + "/generate", json=LONG, timeout=30)
    assert later.status_code == 500 and "tp rank 1" in later.json()["error"]["message"]
    wait_gone(pids, 5)  # the broken group's other ranks are ended too
    server.wait_idle()
    what = "SIGSTOP (hang)" if sig == signal.SIGSTOP else "SIGKILL"
    record_fault(f"TP follower {what} mid-decode", "HTTP 500 naming tp rank 1; /health 503", t_error, 0, None)


def test_rank0_death_ends_the_followers(servers):
    server = servers["rank0"]
    pids = follower_pids(server)
    server.signal(signal.SIGKILL)
    print(f"followers gone {wait_gone(pids, 10):.2f} s after rank 0's SIGKILL")


def test_sigterm_drains_every_rank(servers):
    server = servers["drain"]
    pids = follower_pids(server)
    sigterm_with_a_request_in_flight(server, 200)
    wait_gone(pids, 5)


def test_tp_size_that_does_not_split_the_model_fails_at_startup(model_dir):
    port = free_port()
    server = ServerProcess(["serve", "--model", str(model_dir), "--tp-size", "3", "--port", str(port)], port)
    code, last = server.run_to_exit(300)
    assert code != 0
    assert "--tp-size 3 does not divide the model's num_attention_heads 8, num_key_value_heads 4" in last
