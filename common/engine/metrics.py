"""Prometheus metrics of one server process (own registry, so tests can run several engines); /metrics
labels every sample with the server's role (common/edge/prometheus.py)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.edge.prometheus import render

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
SPAN_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
REJECTED_NAME = "tandem_rejected_inputs"  # exposed as tandem_rejected_inputs_total
REJECTED_DOC = (
    "inputs rejected at a boundary (http: 4xx answers of the HTTP edge; control, bootstrap: see their owners)"
)

log = logging.getLogger(__name__)


class RejectedInputs:
    """The `tandem_rejected_inputs_total{where}` family: counts kept here (the HTTP edge) and counts
    kept by other components, read through callables at scrape time, so every `where` is one family."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {"http": 0}
        self._sources: dict[str, Callable[[], float]] = {}

    def inc(self, where: str, n: int = 1) -> None:
        if where in self._sources:
            raise ValueError(f"rejections at {where!r} are read from a source; they cannot be counted here")
        with self._lock:
            self._counts[where] = self._counts.get(where, 0) + n

    def add_source(self, where: str, read: Callable[[], float]) -> None:
        with self._lock:
            if where in self._counts or where in self._sources:
                raise ValueError(f"rejections at {where!r} are already counted")
            self._sources[where] = read

    def remove_source(self, where: str) -> None:
        with self._lock:
            self._sources.pop(where, None)

    def values(self) -> dict[str, float]:
        with self._lock:
            values: dict[str, float] = dict(self._counts)
            sources = dict(self._sources)
        for where, read in sources.items():
            try:
                values[where] = float(read())
            except Exception:  # a broken source must not take /metrics down with it
                log.exception("reading the rejection count of %r failed", where)
        return values

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(REJECTED_NAME, REJECTED_DOC, labels=["where"])

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(REJECTED_NAME, REJECTED_DOC, labels=["where"])
        for where, value in sorted(self.values().items()):
            family.add_metric([where], value)
        yield family


class LabelledGauges:
    """One gauge family whose samples, one per label value, are read at scrape time (the values read
    may come and go, as a role's queues do)."""

    def __init__(self, name: str, doc: str, label: str, read: Callable[[], dict[str, float]]):
        self.name, self.doc, self.label, self.read = name, doc, label, read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.doc, labels=[self.label])
        for value, n in sorted(self.read().items()):
            family.add_metric([value], n)
        yield family


class CounterSource:
    """One counter whose value another component keeps (read at scrape time)."""

    def __init__(self, name: str, doc: str, read: Callable[[], float]):
        self.name, self.doc, self.read = name, doc, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.doc, value=float(self.read()))


class EngineMetrics:
    def __init__(self, role: str) -> None:
        """`role`: the server's --disaggregation-mode (null, prefill or decode), the `role` label of its samples."""
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tandem_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.finished = Counter("tandem_requests_finished", "finished requests by reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "prompt tokens received", registry=r)
        self.generated_tokens = Counter("tandem_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds", "time between tokens", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds", "request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.spans = Histogram(
            "tandem_request_span_seconds",
            "seconds from a request's arrival to one step of it (span: the step, see common/core/timeline.py)",
            ["span"],
            buckets=SPAN_BUCKETS,
            registry=r,
        )
        self.rejected = RejectedInputs()
        r.register(self.rejected)

    def count_rejection(self, where: str, n: int = 1) -> None:
        """One more input rejected at `where` (e.g. "http": a 4xx answer of the HTTP edge)."""
        self.rejected.inc(where, n)

    def add_rejection_source(self, where: str, read: Callable[[], float]) -> None:
        """Report rejections counted elsewhere (e.g. "control": `lambda: manager.counters["rejected_messages"]`)
        as `tandem_rejected_inputs_total{where=...}`; `read` is called from the /metrics handler's thread."""
        self.rejected.add_source(where, read)

    def drop_transfer_metrics(self, collector) -> None:
        """Stop reporting a PD role's transfer metrics (`collector`, and its "control" rejections): the role ended
        (a role switch), the next one registers its own."""
        self.registry.unregister(collector)
        self.rejected.remove_source("control")

    def gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        Gauge(name, doc, registry=self.registry).set_function(fn)

    def labelled_gauges(self, name: str, doc: str, label: str, read: Callable[[], dict[str, float]]) -> None:
        """A gauge family `name{label}` whose samples are `read()` at scrape time, from the /metrics thread."""
        self.registry.register(LabelledGauges(name, doc, label, read))

    def counter_source(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A counter `name_total` kept elsewhere, `read()` at scrape time from the /metrics thread."""
        self.registry.register(CounterSource(name, doc, read))

    def render(self) -> bytes:
        return render(self.registry, self.role)
