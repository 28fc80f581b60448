"""A KVManager's event counters as one Prometheus counter family, read at scrape time."""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily

from transfer.manager import KVManager

EVENTS = ("chunks_sent", "bytes_sent", "rooms_succeeded", "rooms_failed", "peers_declared_dead", "peers_refused",
          "writes_fenced", "rejected_messages", "dropped_sends")


class TransferCounters:
    def __init__(self, manager: KVManager):
        self.manager = manager

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("tandem_kv_transfer_events", "KV transfer control and data plane events", labels=["event"])
        for event in EVENTS:
            family.add_metric([event], self.manager.counters[event])
        yield family
