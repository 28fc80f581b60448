"""The workers the router knows, their health (checked in the background) and load.

A worker taken out of rotation ends every request in flight on it at once: each registers in the
worker's `calls` while it depends on the worker (see router/pair_call.py). A worker that passes a
health check again is used again. A draining worker (503 + X-Tandem-Draining on /health) leaves the
rotation without ending its calls: it finishes, or fails, its requests itself. A worker's role (a role switch
changes it) comes with its /health, and with its refusal of a request meant for its old role (router/dispatch.py).
A healthy worker's /v1/models is read in the same round: the LoRA adapters it serves (router/adapters.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlparse

import aiohttp

from common.wire.api import BOOTSTRAP_HEADER, INSTANCE_HEADER, RECOMPUTE_HEADER, ROLE_HEADER
from common.wire.drain import DRAINING_HEADER
from router.adapters import ServedModels, served_models

log = logging.getLogger("tandem.router")


class Call(Protocol):
    def worker_down(self, worker: Worker) -> None:
        """End the request now: `worker` was taken out of rotation (its `down_reason` says why)."""


@dataclass
class Worker:
    url: str
    role: str  # "prefill" | "decode"
    bootstrap_port: int | None = None
    bootstrap_host: str | None = None  # a standalone registry's; None: the prefill's own (its host)
    # the name an https worker's certificate must carry: a discovered one's discovery name (a Service's name,
    # while the URL holds the pod's address); None: the URL's host
    tls_name: str | None = None
    healthy: bool = False  # until its first health check passes
    failures: int = 0  # in a row: health checks and connection-level request failures
    in_flight: int = 0
    instance_id: str | None = None  # from its /health answer: which transfer instance it is right now
    recomputes: bool = False  # a decode that computes a prompt whose KV did not arrive (its /health says so)
    models: ServedModels | None = None  # its /v1/models: base model and LoRA adapters (None: not known)
    calls: set[Call] = field(default_factory=set)  # requests in flight that end if this worker is taken out
    down_reason: str = ""

    @functools.cached_property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"

    def get(self, session: aiohttp.ClientSession, path: str, timeout_s: float):
        """`async with worker.get(...) as r`: GET `path` of this worker within `timeout_s` (an https worker's
        certificate checked against its tls_name)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        return session.get(self.url + path, timeout=timeout, server_hostname=self.tls_name)

    @property
    def registry_host(self) -> str:
        """Where a decode looks this prefill up: its standalone bootstrap registry, or itself."""
        return self.bootstrap_host or self.host

    def to_dict(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_host": self.bootstrap_host,
            "healthy": self.healthy,
            "failures": self.failures,
            "in_flight": self.in_flight,
        }


class WorkerRegistry:
    def __init__(self, failure_threshold: int, check_timeout_s: float = 2.0, read_models: bool = True):
        """`read_models`: read a healthy worker's /v1/models in each health round (--adapter-routing)."""
        self.workers: dict[str, Worker] = {}
        self.failure_threshold = failure_threshold
        self.check_timeout_s = check_timeout_s
        self.read_models = read_models

    def add(
        self,
        url: str,
        role: str,
        bootstrap_port: int | None = None,
        bootstrap_host: str | None = None,
        tls_name: str | None = None,
    ) -> Worker:
        url = url.rstrip("/")
        if role not in ("prefill", "decode"):
            raise ValueError("role must be prefill or decode")
        w = self.workers[url] = Worker(url, role, bootstrap_port, bootstrap_host, tls_name)
        return w

    def remove(self, url: str) -> bool:
        return self.workers.pop(url.rstrip("/"), None) is not None

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def mark(self, worker: Worker, ok: bool, failure: str = "a health check failed") -> None:
        """Record one health check or request outcome; `failure` says what went wrong when not ok."""
        if ok:
            self._recover(worker)
            return
        worker.failures += 1
        if worker.healthy and worker.failures >= self.failure_threshold:
            self._take_out(worker, failure)

    def _recover(self, worker: Worker) -> None:
        if not worker.healthy:
            log.info("%s worker %s is healthy", worker.role, worker.url)
        worker.failures, worker.healthy, worker.down_reason = 0, True, ""

    def _take_out(self, worker: Worker, failure: str) -> None:
        worker.healthy = False
        worker.down_reason = (
            f"{worker.role} worker {worker.url} failed health checks and was taken out of rotation "
            f"({worker.failures} failures in a row; the last: {failure})"
        )
        log.warning("%s; ending its %d requests in flight", worker.down_reason, len(worker.calls))
        for call in list(worker.calls):
            call.worker_down(worker)

    def follow(self, worker: Worker, header: Callable[[str], str | None]) -> None:
        """What a worker's role headers say (`header(name)`: its /health's, or those of its refusal of a request meant
        for another role, common/http/role_guard.py): its transfer instance, whether it recomputes, its role."""
        worker.instance_id = header(INSTANCE_HEADER) or worker.instance_id
        worker.recomputes = header(RECOMPUTE_HEADER) == "1"
        self.follow_role(worker, header(ROLE_HEADER), header(BOOTSTRAP_HEADER))

    def follow_role(self, worker: Worker, role: str | None, bootstrap: str | None) -> None:
        """The role a worker's /health names (a role switch changed it: POST /pd_role_switch), and a prefill's
        bootstrap registry (HOST:PORT)."""
        if role in ("prefill", "decode") and role != worker.role:
            log.info("%s worker %s is now a %s worker", worker.role, worker.url, role)
            worker.role = role
        if role == "prefill" and bootstrap:
            host, _, port = bootstrap.rpartition(":")
            if port.isdigit():
                worker.bootstrap_port = int(port)
                worker.bootstrap_host = host if host and host != worker.host else None

    def set_draining(self, worker: Worker) -> None:
        """The worker is shutting down gracefully: out of rotation, but its requests in flight run on
        (its calls are not ended; they end when the worker ends them)."""
        if worker.healthy:
            log.info("%s worker %s is draining; no new requests go to it", worker.role, worker.url)
        worker.healthy = False

    async def check(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        """One GET /health; slower than the check timeout counts as a failure."""
        try:
            async with worker.get(session, "/health", self.check_timeout_s) as r:
                self.follow(worker, r.headers.get)
                if r.status == 503 and r.headers.get(DRAINING_HEADER):
                    self.set_draining(worker)
                    return
                self.mark(worker, r.status == 200, f"GET /health answered HTTP {r.status}")
            if worker.healthy and self.read_models:
                await self.learn_models(session, worker)
        except asyncio.TimeoutError:
            self.mark(worker, False, f"GET /health timed out after {self.check_timeout_s:g} s")
        except aiohttp.ClientError as e:
            self.mark(worker, False, f"GET /health failed: {type(e).__name__}: {e}")

    async def learn_models(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        """Its /v1/models: the adapters it serves now (unknown when it has no such list)."""
        try:
            async with worker.get(session, "/v1/models", self.check_timeout_s) as r:
                worker.models = served_models(await r.json(content_type=None)) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            worker.models = None

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(session, w) for w in list(self.workers.values())))

    async def health_loop(self, session: aiohttp.ClientSession, interval: float) -> None:
        while True:
            try:
                await self.check_all(session)
            except Exception:  # a bug here must not stop health checking for good
                log.exception("health check round failed")
            await asyncio.sleep(interval)
