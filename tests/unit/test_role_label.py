"""Every sample of a process's /metrics carries the process's role (common/edge/prometheus.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from common.edge.prometheus import render


def test_every_sample_gets_the_role_and_keeps_its_own_labels():
    registry = CollectorRegistry()
    Counter("c", "a counter", ["where"], registry=registry).labels("http").inc(3)
    Histogram("h_seconds", "a histogram", buckets=(1,), registry=registry).observe(0.5)
    samples = [s for f in text_string_to_metric_families(render(registry, "decode").decode()) for s in f.samples]
    assert {(s.name, s.value) for s in samples if s.labels == {"where": "http", "role": "decode"}} >= {("c_total", 3)}
    assert {s.name for s in samples if s.labels.get("le") == "1.0"} == {"h_seconds_bucket"}
    assert all(s.labels["role"] == "decode" for s in samples) and len(samples) >= 6
    assert registry.get_sample_value("c_total", {"where": "http"}) == 3  # the registry itself is unchanged


def test_a_metric_with_its_own_role_label_and_an_unknown_role_are_refused():
    registry = CollectorRegistry()
    Counter("errors", "by worker role", ["role"], registry=registry).labels("prefill").inc()
    with pytest.raises(ValueError, match="metric errors has a label named 'role'.*name that label otherwise"):
        render(registry, "router")
    with pytest.raises(
        ValueError, match="role must be one of null, prefill, decode, router, bootstrap, planner, not 'gateway'"
    ):
        render(CollectorRegistry(), "gateway")
