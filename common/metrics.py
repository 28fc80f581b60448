"""Prometheus metrics of one server process (own registry, so tests can run several engines)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.finished = Counter("tandem_requests_finished", "finished requests by reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "prompt tokens received", registry=r)
        self.generated_tokens = Counter("tandem_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "time between tokens", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("tandem_rejected_inputs", "inputs rejected at a boundary", ["where"], registry=r)

    def gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        Gauge(name, doc, registry=self.registry).set_function(fn)

    def render(self) -> bytes:
        return generate_latest(self.registry)
