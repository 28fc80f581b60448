"""The workers the router knows, their health (checked in the background) and load."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from urllib.parse import urlparse

import aiohttp

log = logging.getLogger("tandem.router")


@dataclass
class Worker:
    url: str
    role: str  # "prefill" | "decode"
    bootstrap_port: int | None = None
    healthy: bool = False  # until its first health check passes
    failures: int = 0
    in_flight: int = 0

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"

    def to_dict(self) -> dict:
        return {"url": self.url, "role": self.role, "bootstrap_port": self.bootstrap_port, "healthy": self.healthy, "in_flight": self.in_flight}


class WorkerRegistry:
    def __init__(self, failure_threshold: int):
        self.workers: dict[str, Worker] = {}
        self.failure_threshold = failure_threshold

    def add(self, url: str, role: str, bootstrap_port: int | None = None) -> Worker:
        url = url.rstrip("/")
        if role not in ("prefill", "decode"):
            raise ValueError("role must be prefill or decode")
        w = self.workers[url] = Worker(url, role, bootstrap_port)
        return w

    def remove(self, url: str) -> bool:
        return self.workers.pop(url.rstrip("/"), None) is not None

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def mark(self, worker: Worker, ok: bool) -> None:
        if ok:
            if not worker.healthy:
                log.info("%s worker %s is healthy", worker.role, worker.url)
            worker.failures, worker.healthy = 0, True
            return
        worker.failures += 1
        if worker.healthy and worker.failures >= self.failure_threshold:
            worker.healthy = False
            log.warning("%s worker %s failed %d health checks: taken out of rotation", worker.role, worker.url, worker.failures)

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        async def check(w: Worker) -> None:
            try:
                async with session.get(w.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    self.mark(w, r.status == 200)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                self.mark(w, False)

        await asyncio.gather(*(check(w) for w in list(self.workers.values())))

    async def health_loop(self, session: aiohttp.ClientSession, interval: float) -> None:
        while True:
            await self.check_all(session)
            await asyncio.sleep(interval)
