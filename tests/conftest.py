"""Shared fixtures: real server processes on 127.0.0.1 and the built-in model; the test tiers
(tests/tiers.py: which tests are slow, Hypothesis example counts)."""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.forked import ForkedServer, can_fork, kill_left_over
from tests.ports import free_port
from tests.served_model import served_model_flags
from tests.shared_ssl import share_default_ssl_context
from tests.tiers import load_hypothesis_profile, mark_slow_tests, starts_processes

ROOT = Path(__file__).resolve().parent.parent
load_hypothesis_profile()
share_default_ssl_context()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_slow_tests(items)


IMAGE_TEST = "tests/helm/test_chart_image.py"


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the image test is selected: it runs last, and the image it builds starts building now, in the
    background (tests/helm/image.py `start_build`): a cold build's downloads and disk writes overlap the rest.
    So does the venv of a tool a selected test runs (tests/tool_venv.py)."""
    if not session.config.option.collectonly:
        from tests.tool_venv import TOOLS, start_install

        for name in TOOLS:
            if any(name in item.fixturenames for item in session.items):
                start_install(name)
    image = [item for item in session.items if item.nodeid.startswith(IMAGE_TEST)]
    if not image or session.config.option.collectonly:
        return
    session.items[:] = [item for item in session.items if item not in image] + image
    from tests.helm.image import cannot_build, start_build

    if cannot_build() is None:
        start_build("cpu")


def pytest_sessionfinish() -> None:
    from tests.helm.image import stop_builds
    from tests.tool_venv import stop_installs

    stop_builds()
    stop_installs()
    kill_left_over()


# how a server says that a port it was given is taken: its start-up check, or uvicorn's bind after the load
PORT_TAKEN = re.compile(r"(\d+): another process listens on|address \('[^']*', (\d+)\)[^\n]*in use", re.I)


@starts_processes
class ServerProcess:
    """A `python -m tandem <args>` child process; stop() kills it and its log is kept for failures."""

    entry: tuple[str, ...] = (sys.executable, "-m", "tandem")  # how `tandem` is run (after `prefix`)

    def __init__(
        self,
        args: list[str],
        port: int,
        name: str = "server",
        health: str = "/health",
        env: dict[str, str] | None = None,
        tls_ca: str | None = None,
        host: str = "127.0.0.1",
        prefix: tuple[str, ...] = (),
    ):
        self.port = port
        self.env = env or {}  # on top of this process's environment
        # with TLS (the server has --ssl-certfile), the CA this test's requests verify it with
        self.verify = ssl.create_default_context(cafile=tls_ca) if tls_ca else True
        self.url = f"{'https' if tls_ca else 'http'}://{host}:{port}"
        self.prefix = prefix  # runs the command inside something, e.g. ("ip", "netns", "exec", NAME)
        self.name = name
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-test-{name}-{port}.log"
        if args[:1] == ["serve"] and not {"--model", "--model-path"} & set(
            args
        ):  # tests/served_model.py: the cut built-in model
            args = [*args, *served_model_flags()]
        self.args = args
        self._log = open(self.log_path, "wb")
        self.health = health
        self.proc = self._spawn()
        self.moves = 0  # times the first start moved to fresh ports (tests/ports.py)

    @property
    def auth(self) -> dict[str, str]:
        """The Authorization header of the API key given as `--api-key` (none without one)."""
        key = self.args[self.args.index("--api-key") + 1] if "--api-key" in self.args else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _spawn(self) -> subprocess.Popen | ForkedServer:
        self._log_start = self.log_path.stat().st_size  # where this start's output begins
        env = os.environ | self.env | {"PYTHONUNBUFFERED": "1"}
        if self.entry == ServerProcess.entry and can_fork(self.args, self.prefix):
            return ForkedServer(self.args, env, ROOT, self.log_path, self.env.get("PYTHONPATH"), self.prefix)
        return subprocess.Popen(
            [*self.prefix, *self.entry, *self.args], cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    def arg(self, flag: str) -> str | None:
        """The value given to `flag` (the current one, if the server moved ports), None without it."""
        return self.args[self.args.index(flag) + 1] if flag in self.args else None

    def signal(self, sig: int) -> None:
        """SIGKILL, SIGSTOP, SIGCONT... to the server process (a fault injected by a test)."""
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    def restart(self) -> ServerProcess:
        """The same command again on the same port (after a kill or stop()); its log is appended to.
        Call wait_ready() next."""
        self._respawn()
        self.moves = -1  # on its own port again: a test (or a router) already knows it
        return self

    def _respawn(self) -> None:
        self.stop()
        self._log = open(self.log_path, "ab")
        self.proc = self._spawn()

    def _move_off_taken_port(self) -> bool:
        """After the first start exited because a port it was given is taken: the same command started
        again with a fresh port in its place (at most 3 times). Whether it was started again."""
        taken = PORT_TAKEN.search(self.log_path.read_bytes()[self._log_start :].decode(errors="replace"))
        if taken is None or not 0 <= self.moves < 3:
            return False
        port = taken.group(1) or taken.group(2)
        flags = [i for i, a in enumerate(self.args[:-1]) if a.endswith("-port") and self.args[i + 1] == port]
        if not flags:
            return False
        fresh = free_port()
        for i in flags:
            self.args[i + 1] = str(fresh)
        if int(port) == self.port:
            self.port = fresh
            self.url = self.url.rsplit(":", 1)[0] + f":{fresh}"
        self._respawn()
        self.moves += 1
        return True

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not self._move_off_taken_port():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.health, timeout=2, verify=self.verify).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready after {timeout} s:\n{self.log_tail()}")

    def run_to_exit(self, timeout: float = 120.0) -> tuple[int, str]:
        """For a command that is to fail at start-up: its exit code and the last line of its output."""
        code = self.proc.wait(timeout)
        self._log.close()
        return code, self.log_tail(1)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def info(self) -> dict:
        r = httpx.get(self.url + "/get_server_info", timeout=30, verify=self.verify, headers=self.auth)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Pool integrity holds and no page is held by a request (all back to free or cache)."""
        deadline = time.monotonic() + timeout
        while True:
            pages = self.info()["kv_pages"]
            if pages["in_use"] == 0 and pages["locked"] == 0:
                assert pages["free"] + pages["cached"] == pages["total"]
                return pages
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} still holds KV pages: {pages}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen process would ignore SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_server(*args: str, name: str = "server", tls_ca: str | None = None) -> ServerProcess:
    """A server process; the KV cache is kept small (8192 tokens) unless the test asks otherwise,
    so that many servers fit in this machine's memory at once. `tls_ca`: see ServerProcess."""
    port = free_port()
    if "--max-total-tokens" not in args:
        args = (*args, "--max-total-tokens", "8192")
    return ServerProcess(["serve", "--port", str(port), *args], port, name=name, tls_ca=tls_ca)


@starts_processes
class ReferenceServers:
    """Monolithic servers shared by modules: those that give the reference outputs PD is compared with, and
    those the API tests call. One per distinct command line, started on first use and shared by every
    module that asks for the same one (tests only generate on them: none is killed, drained or scraped
    for counts), stopped at the session's end."""

    def __init__(self) -> None:
        self.running: dict[tuple[str, ...], ServerProcess] = {}

    def get(self, *args: str) -> ServerProcess:
        if "--max-total-tokens" not in args:  # start_server's default, explicit: one key for both spellings
            args = (*args, "--max-total-tokens", "8192")
        if args not in self.running:
            self.running[args] = start_server(*args, name=f"mono-ref{len(self.running)}").wait_ready()
        return self.running[args]

    def stop(self) -> None:
        for server in self.running.values():
            server.stop()


@pytest.fixture(scope="session")
def reference_servers():
    servers = ReferenceServers()
    yield servers
    servers.stop()


@starts_processes
class SharedClusters:
    """PD clusters (tests/integration/cluster.py: prefill, decode, router) shared by the modules that ask for the
    same backend and flags (test_pd runs through one; test_tp_pd pairs its TP 1 servers with its TP 3 ones).
    Started on first use; stopped once `users` modules said `done` (the modules that share it), else at the
    session's end. Tests on them generate only: none is killed or drained."""

    def __init__(self) -> None:
        self.running: dict[tuple, Any] = {}
        self.done_by: dict[tuple, int] = {}

    def get(self, backend: str, flags: tuple[str, ...]) -> Any:
        from tests.integration.cluster import start_cluster

        key = (backend, flags)
        if key not in self.running:
            self.running[key] = start_cluster(backend, flags=flags)
        return self.running[key]

    def done(self, backend: str, flags: tuple[str, ...], users: int) -> None:
        key = (backend, flags)
        self.done_by[key] = self.done_by.get(key, 0) + 1
        if self.done_by[key] >= users and key in self.running:
            self.running.pop(key).stop()

    def stop(self) -> None:
        for cluster in self.running.values():
            cluster.stop()


@pytest.fixture(scope="session")
def shared_clusters():
    clusters = SharedClusters()
    yield clusters
    clusters.stop()


@pytest.fixture(scope="session")
def builtin_model_dir() -> Path:
    from common.model.loader import resolve_model_dir

    return resolve_model_dir("builtin")


def sample(metrics_text: str, name: str, labels: dict[str, str]) -> float:
    """The value of the Prometheus sample with exactly these labels; 0 when it does not exist yet."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of url/metrics whose labels include `labels` (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


FAULT_ROWS: list[tuple[str, ...]] = []


def record_fault(
    fault: str, client_saw: str, time_to_error_s: float | None, pages_leaked: int, recovery_s: float | None
) -> None:
    """One row of the fault table printed at the end of the run (and quoted in release notes)."""
    fmt = lambda s: "-" if s is None else f"{s:.2f} s"  # noqa: E731
    FAULT_ROWS.append((fault, client_saw, fmt(time_to_error_s), str(pages_leaked), fmt(recovery_s)))


def pytest_terminal_summary(terminalreporter) -> None:
    if not FAULT_ROWS:
        return
    tr = terminalreporter
    tr.section("faults: what the client saw, time to error, pages leaked, recovery")
    header = ("fault", "client saw", "time to error", "pages leaked", "recovery")
    widths = [max(len(r[i]) for r in [header, *FAULT_ROWS]) for i in range(5)]
    for row in [header, *FAULT_ROWS]:
        tr.write_line(" | ".join(c.ljust(w) for c, w in zip(row, widths)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tests.integration.tiny_model import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
