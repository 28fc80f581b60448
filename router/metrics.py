"""The router's Prometheus metrics (its own registry). With several router processes on one port
(router/processes.py) they use prometheus_client's multiprocess mode: every process writes its values to
files, /metrics of any process adds them up, and the gauges are refreshed twice a second."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from router.workers import WorkerRegistry

REFRESH_S = 0.5


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry, in_flight: Callable[[], int], multiprocess_dir: str | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tandem_router_requests", "requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.upstream_errors = Counter("tandem_router_upstream_errors", "errors from workers", ["role"], registry=r)
        self.cancelled = Counter("tandem_router_cancelled_requests", "requests whose pair was cancelled early, by cause "
                                 "(prefill_failed, decode_failed, worker_dead, client_disconnected)", ["cause"], registry=r)
        self.retries = Counter("tandem_router_retries", "requests retried on another pair", registry=r)
        self.latency = Histogram("tandem_router_request_latency_seconds", "request latency", registry=r)
        self.in_flight = Gauge("tandem_router_in_flight_requests", "generation requests in flight", registry=r,
                               multiprocess_mode="livesum")
        self.healthy = Gauge("tandem_router_healthy_workers", "healthy workers by role", ["role"], registry=r,
                             multiprocess_mode="livemax")
        self.multiprocess_dir = multiprocess_dir
        self._read_in_flight, self._workers = in_flight, workers
        if multiprocess_dir is None:  # read when scraped
            self.in_flight.set_function(in_flight)
            for role in ("prefill", "decode"):
                self.healthy.labels(role).set_function(lambda role=role: len(workers.healthy(role)))

    def refresh(self) -> None:
        """Write the gauges' current values (multiprocess mode: the scraping process cannot read ours)."""
        self.in_flight.set(self._read_in_flight())
        for role in ("prefill", "decode"):
            self.healthy.labels(role).set(len(self._workers.healthy(role)))

    def render(self) -> bytes:
        """The text exposition of every metric, of all processes in multiprocess mode."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, self.multiprocess_dir)
        return generate_latest(registry)
