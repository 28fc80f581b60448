"""The router's Prometheus metrics (its own registry)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.workers import WorkerRegistry


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry, in_flight: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tandem_router_requests", "requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.upstream_errors = Counter("tandem_router_upstream_errors", "errors from workers", ["role"], registry=r)
        self.cancelled = Counter("tandem_router_cancelled_requests", "requests whose pair was cancelled early, by cause "
                                 "(prefill_failed, decode_failed, worker_dead, client_disconnected)", ["cause"], registry=r)
        self.retries = Counter("tandem_router_retries", "requests retried on another pair", registry=r)
        self.latency = Histogram("tandem_router_request_latency_seconds", "request latency", registry=r)
        Gauge("tandem_router_in_flight_requests", "generation requests in flight", registry=r).set_function(in_flight)
        healthy = Gauge("tandem_router_healthy_workers", "healthy workers by role", ["role"], registry=r)
        for role in ("prefill", "decode"):
            healthy.labels(role).set_function(lambda role=role: len(workers.healthy(role)))
