"""A KVManager's Prometheus metrics: its event counters (read at scrape time), the per-room transfer
latency and the transfer failures by cause. The engine's registry exposes them (prefill_node/compose.py,
decode_node/compose.py)."""

from __future__ import annotations

from collections import Counter as Counts
from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

EVENTS = (
    "chunks_sent",
    "bytes_sent",
    "rooms_succeeded",
    "rooms_failed",
    "peers_declared_dead",
    "peers_refused",
    "writes_fenced",
    "rejected_messages",
    "dropped_sends",
    "rooms_recomputed",  # decode: rooms whose KV did not arrive, computed here (--kv-load-failure-policy recompute)
)
# Why a room failed, as the side that counts it saw it (bounded: these and no other label values).
CAUSES = (
    "timeout",  # decode: no KV within --kv-wait-timeout-s
    "peer_dead",  # the peer answered no heartbeat within the window
    "aborted",  # this side's request ended first (client gone, bootstrap timeout, drain, error)
    "peer_aborted",  # prefill: the decode asked to stop
    "peer_failed",  # decode: the prefill reported a failure (its own metrics name the cause)
    "fenced",  # prefill: a write refused because the decode may have reused its pages
    "queue_full",  # prefill: the decode's transfer queue held its bound of chunks
    "refused_layout",  # prefill: a room asked for by a decode whose KV layout differs
    "transfer_error",  # prefill: the transfer backend failed a write
    "worker_died",  # prefill: the transfer thread died of a bug
    "duplicate",  # a room id another request holds, or asked for twice
    "overrun",  # prefill: a chunk larger than the pages the decode reserved
    "checksum",  # decode: the pages that arrived differ from the prefill's checksums (transfer/checksum.py)
)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class TransferMetrics:
    """A collector; the manager counts failures with `failed(cause)` and observes `latency`: on a prefill
    from a room's first chunk queued to its success status sent, on a decode from its request for the KV
    to the prefill's success status."""

    def __init__(self, counters: Counts[str]):
        self.counters = counters  # the manager's event counts, shared with its control plane
        self.latency = Histogram(
            "tandem_kv_transfer_latency_seconds",
            "seconds per successful room: prefill from its "
            "first chunk queued to its status, decode from its request to the status",
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.failures = Counter(
            "tandem_kv_transfer_failures", "rooms failed, by cause (see transfer/metrics.py)", ["cause"], registry=None
        )
        for cause in CAUSES:  # every cause is exported from the start, at 0
            self.failures.labels(cause)
        self.rank_bytes: Counts[int] | None = None  # prefill: KV bytes each TP rank's own engine wrote

    def failed(self, cause: str) -> None:
        if cause not in CAUSES:
            raise ValueError(f"unknown transfer failure cause {cause!r}: add it to transfer.metrics.CAUSES")
        self.failures.labels(cause).inc()

    def collect(self) -> Iterator[Metric]:
        events = CounterMetricFamily(
            "tandem_kv_transfer_events", "KV transfer control and data plane events", labels=["event"]
        )
        for event in EVENTS:
            events.add_metric([event], self.counters[event])
        yield events
        # the seconds the chunks above took to write: bytes_sent / this is the wire's measured rate (the router's
        # placement cost reads it, docs/placement.md)
        yield CounterMetricFamily(
            "tandem_kv_transfer_write_seconds",
            "seconds spent writing KV chunks (prefill), summed over its transfer threads",
            value=self.counters["write_microseconds"] / 1e6,
        )
        yield from self.latency.collect()
        yield from self.failures.collect()
        if self.rank_bytes is not None:
            ranks = CounterMetricFamily(
                "tandem_kv_rank_bytes", "KV bytes written by each TP rank's own transfer engine", labels=["rank"]
            )
            for rank, nbytes in sorted(self.rank_bytes.items()):
                ranks.add_metric([str(rank)], nbytes)
            yield ranks
