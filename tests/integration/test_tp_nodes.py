"""A TP group spanning two "nodes" on 127.0.0.1 (`--nnodes 2 --node-rank k --dist-init-addr`), tiny random
Llama (8 heads, 4 KV heads): TP 4 over 2 nodes gives transformers' greedy tokens over HTTP (as TP 1 does,
test_tensor_parallel); killing node 1's process turns node 0's /health 503 naming node 1's ranks within
the heartbeat window and the request in flight fails naming them; killing node 0 ends node 1's
processes within the window; a rank on node 1 that hangs is named by node 0's step watchdog; SIGTERM on
node 0 drains and stops every rank on both nodes; a prefill and a decode, each over two nodes, give
transformers' greedy tokens. Five groups start together (each fault ends its group); the bounds are
printed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port, record_fault, start_server
from tests.forked import ForkedServer, can_fork
from tests.integration.test_tensor_parallel import assert_same_tokens, generate_all, greedy_reference
from tests.integration.test_tp_faults import in_flight, sigterm_with_a_request_in_flight, wait_gone
from tests.integration.test_tp_pd import pair_call
from tests.integration.tiny_model import random_prompts, save_tiny_llama
from tests.tiers import starts_processes

INTERVAL_S, MISSES = 0.5, 6  # a 3 s window: a loaded machine delays a beat by seconds
WINDOW_S = INTERVAL_S * MISSES
HEARTBEAT = ("--heartbeat-interval-s", str(INTERVAL_S), "--heartbeat-misses", str(MISSES))
WATCHDOG_S = 4.0


@starts_processes
class Node:
    """`tandem serve --node-rank K` (K > 0): no HTTP, only its ranks."""

    def __init__(self, args: list[str], name: str):
        self.log_path = Path("/tmp") / f"tandem-test-{name}.log"
        self.log_path.write_bytes(b"")
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        if can_fork(["serve"], ()):  # tests/forked.py, as ServerProcess's servers
            self.proc = ForkedServer(["serve", *args], env, ROOT, self.log_path, None)
            return
        with open(self.log_path, "wb") as log:
            cmd = [sys.executable, "-m", "tandem", "serve", *args]
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def rendezvous_port() -> int:
    """A free port below the ephemeral range (tests/ports.py), as a deployment's --dist-init-addr is: node 1
    retries its connection until node 0 listens, and a connection to an ephemeral port may get that very
    port as its own (TCP self-connect), which then keeps node 0 from listening there."""
    return free_port()


def start_group(model_dir: Path, tp: int, name: str, extra: tuple[str, ...] = ()):
    """Node 0 (a server) and node 1 of a TP `tp` group, started."""
    addr = f"127.0.0.1:{rendezvous_port()}"
    flags = ["--model", str(model_dir), "--tp-size", str(tp), "--nnodes", "2", "--dist-init-addr", addr, *HEARTBEAT]
    flags += extra
    flags += ["--watchdog-timeout-s", str(WATCHDOG_S)]
    node1 = Node([*flags, "--node-rank", "1"], f"{name}-node1")
    return start_server(*flags, "--node-rank", "0", name=f"{name}-node0"), node1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-nodes"), heads=8, kv_heads=4)


@pytest.fixture(scope="module")
def boot_port():
    return free_port()


@pytest.fixture(scope="module")
def groups(model_dir, boot_port):
    """Started together; the PD pair's decode is killed (node 0) after the PD test."""
    pd = {
        "pd-prefill": ("--disaggregation-mode", "prefill", "--bootstrap-port", str(boot_port)),
        "pd-decode": ("--disaggregation-mode", "decode"),
    }
    sizes = {"tp4": 4, "hang": 2, "drain": 2, "pd-prefill": 2, "pd-decode": 2}
    started = {name: start_group(model_dir, tp, name, pd.get(name, ())) for name, tp in sizes.items()}
    try:
        for server, _ in started.values():
            server.wait_ready(400)
        yield started
    finally:
        for server, node1 in started.values():
            server.stop()
            node1.stop()


def node1_rank_pids(server, tp: int) -> list[int]:
    return [r["pid"] for r in server.info()["tp"]["ranks"][tp // 2 :]]


@pytest.mark.timeout(900)
def test_tp4_over_two_hosts_equals_transformers(groups, model_dir):
    server, _ = groups["tp4"]
    prompts = random_prompts(4, 40, 150, seed=7)
    expected = greedy_reference(model_dir, prompts, 16)
    assert_same_tokens(expected, generate_all(server.url, prompts, 16), "tiny TP 4 over 2 nodes")
    tp = server.info()["tp"]
    assert tp["size"] == 4 and tp["nnodes"] == 2
    assert [(r["rank"], r["kv_heads"], r["first_kv_head"]) for r in tp["ranks"]] == [(r, 1, r) for r in range(4)]
    server.wait_idle()


def test_node1_death_is_named_on_node0(groups):
    """Runs after the parity test on the same group: the group is broken after it."""
    server, node1 = groups["tp4"]
    pids = node1_rank_pids(server, 4)
    with ThreadPoolExecutor(1) as pool:
        fut = in_flight(pool, server)
        t0 = time.monotonic()
        node1.proc.kill()
        r = fut.result()
        t_error = time.monotonic() - t0
    named = "node 1 (tp ranks 2-3)"
    assert r.status_code == 500 and named in r.json()["error"]["message"], r.text
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 503 and named in health.json()["error"]["message"], health.text
    assert t_error < WINDOW_S + 3, f"the request failed {t_error:.2f} s after node 1 died"
    wait_gone(pids, 5)  # node 1's ranks exit with their node's process
    server.wait_idle()
    print(f"node 1 SIGKILL: request failed and /health 503 after {t_error:.2f} s (window {WINDOW_S:g} s)")
    record_fault("TP node 1 SIGKILL mid-decode", "HTTP 500 naming node 1's ranks; /health 503", t_error, 0, None)


def test_a_hung_rank_on_node1_is_named_by_the_step_watchdog(groups):
    server, node1 = groups["hang"]
    [pid] = node1_rank_pids(server, 2)
    with ThreadPoolExecutor(1) as pool:
        fut = in_flight(pool, server)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        r = fut.result()
        t_error = time.monotonic() - t0
    named = f"tp rank 1 (pid {pid} on node 1, state T) has not finished step"
    assert r.status_code == 500 and named in r.json()["error"]["message"], r.text
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 503 and named in health.json()["error"]["message"], health.text
    assert t_error < WATCHDOG_S + 3, f"the request failed {t_error:.2f} s after rank 1 froze"
    assert node1.proc.wait(5) == 1  # it read the posted fault and ended its (frozen) rank
    wait_gone([pid], 5)
    server.wait_idle()
    print(f"rank 1 on node 1 SIGSTOP: request failed and /health 503 after {t_error:.2f} s (watchdog {WATCHDOG_S:g} s)")
    record_fault("TP rank on node 1 SIGSTOP mid-decode", "HTTP 500 naming tp rank 1 on node 1", t_error, 0, None)


def test_pd_with_both_sides_over_two_hosts_equals_transformers(groups, model_dir, boot_port):
    """Prefill TP 2 and decode TP 2, each over two nodes: rank 1 of each runs on its node 1 with its own
    transfer engine (the prefill's writes its KV heads, the decode's receives them). The decode's greedy
    tokens equal transformers', and both pools end clean."""
    (prefill, _), (decode, _) = groups["pd-prefill"], groups["pd-decode"]
    prompts = random_prompts(3, 40, 120, seed=11)
    got = [pair_call((prefill, boot_port), decode, ids) for ids in prompts]
    assert all(r.status_code == 200 for r in got), [r.text for r in got]
    assert_same_tokens(greedy_reference(model_dir, prompts, 16), [r.json() for r in got], "PD over 2 nodes")
    prefill.wait_idle()
    decode.wait_idle()


def test_node0_death_ends_node1(groups):
    """Runs after the PD test on its decode (a group of its own would cost three more processes)."""
    server, node1 = groups["pd-decode"]
    pids = [node1.proc.pid, *node1_rank_pids(server, 2)]
    server.signal(signal.SIGKILL)
    t_gone = wait_gone(pids, WINDOW_S + 5)
    print(f"node 0 SIGKILL: node 1's processes gone after {t_gone:.2f} s")


def test_sigterm_on_node0_drains_every_rank(groups):
    server, node1 = groups["drain"]
    pids = node1_rank_pids(server, 2)
    sigterm_with_a_request_in_flight(server, 100)
    assert node1.proc.wait(10) == 0  # its ranks were stopped by rank 0, not killed
    wait_gone(pids, 5)
