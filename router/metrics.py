"""The router's Prometheus metrics (its own registry; /metrics labels every sample role="router", and a
worker's own role is the `worker_role` label). With several router processes on one port
(router/processes.py) they use prometheus_client's multiprocess mode: every process writes its values to
files, /metrics of any process adds them up, and the gauges are refreshed twice a second."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from common.edge.prometheus import render
from router.workers import WorkerRegistry

if TYPE_CHECKING:
    from router.placement.kv_feeds import KVFeeds

REFRESH_S = 0.5
WORKER_LABELS = ["worker", "worker_role"]


class RouterMetrics:
    def __init__(
        self, workers: WorkerRegistry, in_flight: Callable[[], int], multiprocess_dir: str | None = None
    ) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "tandem_router_requests", "requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.upstream_errors = Counter(
            "tandem_router_upstream_errors", "errors from workers", ["worker_role"], registry=r
        )
        self.cancelled = Counter(
            "tandem_router_cancelled_requests",
            "requests whose pair was cancelled early, by cause "
            "(prefill_failed, decode_failed, worker_dead, client_disconnected, client_error)",
            ["cause"],
            registry=r,
        )
        self.retries = Counter("tandem_router_retries", "requests retried on another pair", registry=r)
        self.migrations = Counter(
            "tandem_router_migrations",
            "requests moved to another pair after their pair failed (--migration-limit), by the failure "
            "(prefill_failed, decode_failed, worker_dead)",
            ["reason"],
            registry=r,
        )
        self.resume_gap = Histogram(
            "tandem_router_migration_resume_gap_seconds",
            "a moved stream's gap: its last event before the cut to its first one from the next pair",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        self.latency = Histogram("tandem_router_request_latency_seconds", "request latency", registry=r)
        self.in_flight = Gauge(
            "tandem_router_in_flight_requests", "generation requests in flight", registry=r, multiprocess_mode="livesum"
        )
        self.healthy = Gauge(
            "tandem_router_healthy_workers",
            "healthy workers by role",
            ["worker_role"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.worker_load = Gauge(
            "tandem_router_worker_in_flight_requests",
            "requests in flight on each worker (its URL)",
            WORKER_LABELS,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.worker_healthy = Gauge(
            "tandem_router_worker_healthy",
            "1 while the worker is in rotation, else 0",
            WORKER_LABELS,
            registry=r,
            multiprocess_mode="livemax",
        )
        self.kv_index_pages = Gauge(
            "tandem_router_kv_index_pages",
            "kv_aware: pages the router's KV index says each worker holds (one sample per router process)",
            WORKER_LABELS,
            registry=r,
            multiprocess_mode="all",
        )
        self.kv_resyncs = Gauge(
            "tandem_router_kv_resyncs",
            "kv_aware: times a worker's pages were forgotten (its events had a gap that replay could not fill, or "
            "went back), per router process",
            registry=r,
            multiprocess_mode="all",
        )
        self.kv_prompt_tokens = Counter(
            "tandem_router_kv_prompt_tokens", "kv_aware: prompt tokens of the requests routed", registry=r
        )
        self.kv_matched_tokens = Counter(
            "tandem_router_kv_matched_tokens",
            "kv_aware: prompt tokens the chosen worker held, by the index (prefill: not computed; decode: not sent)",
            ["worker_role"],
            registry=r,
        )
        self.placements = Counter(
            "tandem_router_placement",
            "requests placed, by path (remote_suffix: the KV past the decode's prefix crossed; remote_full: all of it; "
            "local: the decode computed the prompt) and reason (policy, threshold, least_cost, slo, forced, no_prefill)",
            ["path", "reason"],
            registry=r,
        )
        self.kv_feeds: KVFeeds | None = None  # set by the app
        self.multiprocess_dir = multiprocess_dir
        self._read_in_flight, self._workers = in_flight, workers
        self._shown: set[tuple[str, str]] = set()  # worker label sets exported, so vanished workers can be dropped

    def refresh(self) -> None:
        """Set the gauges to the current values (called when scraped, and twice a second in multiprocess
        mode, where the scraping process cannot read ours)."""
        self.in_flight.set(self._read_in_flight())
        for role in ("prefill", "decode"):
            self.healthy.labels(role).set(len(self._workers.healthy(role)))
        current = {(w.url, w.role): w for w in list(self._workers.workers.values())}
        for gone in self._shown - set(current):
            self.worker_load.remove(*gone)
            self.worker_healthy.remove(*gone)
            if self.kv_feeds is not None:
                self.kv_index_pages.remove(*gone)
        for key, w in current.items():
            self.worker_load.labels(*key).set(w.in_flight)
            self.worker_healthy.labels(*key).set(1 if w.healthy else 0)
        self._shown = set(current)
        if self.kv_feeds is not None:
            for key in current:
                self.kv_index_pages.labels(*key).set(self.kv_feeds.index.pages(key[0]))
            self.kv_resyncs.set(self.kv_feeds.resyncs)

    def render(self) -> bytes:
        """The text exposition of every metric, of all processes in multiprocess mode."""
        if self.multiprocess_dir is None:
            self.refresh()
            return render(self.registry, "router")
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, self.multiprocess_dir)
        return render(registry, "router")
