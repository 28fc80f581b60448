"""The router's Prometheus metrics (its own registry; /metrics labels every sample role="router").

A worker's own role is the `worker_role` label: `role` is the process's (common/wire/prometheus.py)."""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from common.wire.prometheus import render
from router.workers import WorkerRegistry


class WorkerGauges:
    """Each worker's load and health, read at scrape time (discovery adds and removes workers)."""

    def __init__(self, workers: WorkerRegistry):
        self.workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["worker", "worker_role"]
        load = GaugeMetricFamily("tandem_router_worker_in_flight_requests", "requests in flight on each worker (its URL)", labels=labels)
        healthy = GaugeMetricFamily("tandem_router_worker_healthy", "1 while the worker is in rotation, else 0", labels=labels)
        for w in list(self.workers.workers.values()):
            load.add_metric([w.url, w.role], w.in_flight)
            healthy.add_metric([w.url, w.role], 1 if w.healthy else 0)
        yield load
        yield healthy


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry, in_flight: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tandem_router_requests", "requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.upstream_errors = Counter("tandem_router_upstream_errors", "errors from workers", ["worker_role"], registry=r)
        self.cancelled = Counter("tandem_router_cancelled_requests", "requests whose pair was cancelled early, by cause "
                                 "(prefill_failed, decode_failed, worker_dead, client_disconnected)", ["cause"], registry=r)
        self.retries = Counter("tandem_router_retries", "requests retried on another pair", registry=r)
        self.latency = Histogram("tandem_router_request_latency_seconds", "request latency", registry=r)
        Gauge("tandem_router_in_flight_requests", "generation requests in flight", registry=r).set_function(in_flight)
        healthy = Gauge("tandem_router_healthy_workers", "healthy workers by role", ["worker_role"], registry=r)
        for role in ("prefill", "decode"):
            healthy.labels(role).set_function(lambda role=role: len(workers.healthy(role)))
        r.register(WorkerGauges(workers))

    def render(self) -> bytes:
        """The text exposition of every metric, labelled role="router"."""
        return render(self.registry, "router")
