"""`tandem router --processes 2`: two router processes serve one port, their metrics add up, a worker added or
removed at run time reaches both, a process that dies is replaced, and stopping the router stops them all.
The workers are benchmarks/router_mock.py processes (they answer like Tandem servers, with fixed bodies)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, ServerProcess, free_port, metric
from tests.integration.faults import wait_until

sys.path.insert(0, str(ROOT))
from benchmarks.router_mock import bodies  # noqa: E402

DECODE_ANSWER = bodies(16)["/generate", False][0]
REQUESTS = 100  # on fresh connections: the kernel spreads them over both processes


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, str]]:
    procs, urls = [], {}
    try:
        for name, role in (("prefill", "prefill"), ("decode", "decode"), ("decode2", "decode")):
            port = free_port()
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(ROOT / "benchmarks" / "router_mock.py"), "--role", role, "--port", str(port)]
                )
            )
            urls[name] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            wait_until(lambda: _up(url), 30, f"the mock worker {url}")
        yield urls
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def children(router: ServerProcess) -> list[int]:
    return [int(p) for p in Path(f"/proc/{router.proc.pid}/task/{router.proc.pid}/children").read_text().split()]


def generate(router: ServerProcess) -> None:
    """One request on a connection of its own, so that the kernel may give it to either process."""
    r = httpx.post(router.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 16}}, timeout=10)
    assert r.status_code == 200 and r.content == DECODE_ANSWER


def cpu_ticks(pid: int) -> int:
    return sum(int(x) for x in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13])


def every_process_lists(router: ServerProcess, url: str, present: bool) -> bool:
    """Twenty answers to GET /workers on fresh connections all agree that `url` is (or is not) a healthy worker."""
    for _ in range(20):
        listed = {w["url"]: w["healthy"] for w in httpx.get(router.url + "/workers", timeout=5).json()["workers"]}
        if listed.get(url, False) != present or (url in listed) != present:
            return False
    return True


def test_two_processes_share_the_port_the_metrics_and_the_worker_list(workers):
    port = free_port()
    router = ServerProcess(
        [
            "router",
            "--prefill",
            workers["prefill"],
            "8998",
            "--decode",
            workers["decode"],
            "--port",
            str(port),
            "--processes",
            "2",
            "--health-check-interval-s",
            "60",
        ],
        port,
        name="router-processes",
        health="/readiness",
    ).wait_ready(60)
    try:
        pids = children(router)
        assert len(pids) == 2
        shared = next(
            e.split("=", 1)[1]
            for e in Path(f"/proc/{pids[0]}/environ").read_text().split("\0")
            if e.startswith("TANDEM_ROUTER_SHARED_DIR=")
        )
        wait_until(
            lambda: all(every_process_lists(router, workers[w], True) for w in ("prefill", "decode")),
            10,
            "both processes ready",
        )
        before = [cpu_ticks(p) for p in pids]
        for _ in range(REQUESTS):
            generate(router)
        # health checks are a minute apart: the CPU time is the requests'
        assert all(cpu_ticks(p) > b + 2 for p, b in zip(pids, before)), "one process served everything"
        assert metric(router.url, "tandem_router_requests_total", endpoint="/generate", status="200") == REQUESTS
        wait_until(lambda: metric(router.url, "tandem_router_in_flight_requests") == 0, 5, "in-flight gauges back to 0")

        added = httpx.post(router.url + "/workers", json={"url": workers["decode2"], "role": "decode"}, timeout=10)
        assert added.status_code == 200 and added.json()["healthy"]
        wait_until(lambda: every_process_lists(router, workers["decode2"], True), 5, "both processes to list decode2")
        assert (
            httpx.request("DELETE", router.url + "/workers", json={"url": workers["decode2"]}, timeout=10).status_code
            == 200
        )
        wait_until(lambda: every_process_lists(router, workers["decode2"], False), 5, "both processes to drop decode2")

        os.kill(pids[0], signal.SIGKILL)
        wait_until(lambda: len(children(router)) == 2 and pids[0] not in children(router), 10, "a new process")
        wait_until(lambda: every_process_lists(router, workers["decode"], True), 10, "the new process ready")
        for _ in range(20):
            generate(router)
        # a dead process's counts stay counted
        assert metric(router.url, "tandem_router_requests_total", endpoint="/generate", status="200") == REQUESTS + 20
        last = children(router)
    finally:
        router.stop()
    assert router.proc.returncode == 0
    assert not any(Path(f"/proc/{p}").exists() for p in last) and not Path(shared).exists()


def test_sigterm_while_the_processes_start_is_a_clean_stop(workers):
    """SIGTERM as the processes start: every one of them gets it (none is left serving the port), and one still
    importing ends by it (its handler is not installed yet): it had served nothing, so the exit status is 0."""
    port = free_port()
    args = ["router", "--prefill", workers["prefill"], "8998", "--decode", workers["decode"], "--port", str(port)]
    router = ServerProcess([*args, "--processes", "2"], port, name="router-processes-starting")
    wait_until(lambda: len(children(router)) == 2, 10, "both processes started")
    pids = children(router)
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(30) == 0, router.log_tail()
    assert not any(Path(f"/proc/{p}").exists() for p in pids)
