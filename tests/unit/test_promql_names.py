"""The dashboard test's helpers: metric names read out of PromQL and out of /metrics text."""

from __future__ import annotations

import pytest

from common.engine.metrics import EngineMetrics
from tests.promql import dashboard_queries, exported_series, matches, query_metric_names, selectors, variable_queries


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("tandem_router_in_flight_requests", {"tandem_router_in_flight_requests"}),
        (
            'histogram_quantile(0.99, sum by (le, role) (rate(tandem_time_to_first_token_seconds_bucket{role="decode", job=~"a|b"}[$__rate_interval])))',
            {"tandem_time_to_first_token_seconds_bucket"},
        ),
        (
            "sum without (instance) (rate(tandem_requests_total[5m])) / on(job) group_left sum(rate(tandem_router_requests_total[1m] offset 5m))",
            {"tandem_requests_total", "tandem_router_requests_total"},
        ),
        (
            "rate(tandem_e2e_request_latency_seconds_sum[1m]) / rate(tandem_e2e_request_latency_seconds_count[1m]) > bool 0.5",
            {"tandem_e2e_request_latency_seconds_sum", "tandem_e2e_request_latency_seconds_count"},
        ),
        ('label_replace(up{job="tandem"}, "x", "$1", "instance", "(tandem_fake_name)")', {"up"}),
        ("max_over_time(tandem_kv_pages_used[${interval}:1m]) * 2e3", {"tandem_kv_pages_used"}),
    ],
)
def test_query_metric_names(expr, names):
    assert query_metric_names(expr) == names


def test_exported_series_expand_each_family_by_its_type():
    names = exported_series(EngineMetrics("null").render().decode())
    assert {
        "tandem_requests_total",
        "tandem_prompt_tokens_total",
        "tandem_time_to_first_token_seconds_bucket",
        "tandem_time_to_first_token_seconds_sum",
        "tandem_time_to_first_token_seconds_count",
    } <= names
    assert "tandem_requests" not in names and "tandem_time_to_first_token_seconds" not in names


def test_dashboard_queries_walk_rows_and_panels():
    dashboard = {
        "panels": [
            {"type": "row", "panels": [{"targets": [{"expr": "a"}, {"refId": "B"}]}]},
            {"targets": [{"expr": "b"}]},
        ]
    }
    assert list(dashboard_queries(dashboard)) == ["a", "b"]


def test_selectors_and_their_matchers():
    expr = 'sum by (role) (rate(a_total{role=~"prefill|decode", event="x\\"y"}[5m])) / b{role!="router"} + c'
    assert selectors(expr) == [
        ("a_total", [("role", "=~", "prefill|decode"), ("event", "=", 'x\\"y')]),
        ("b", [("role", "!=", "router")]),
    ]
    assert matches("=~", "prefill|decode", "decode") and not matches("=~", "pre", "prefill")  # anchored
    assert matches("!=", "router", "null") and not matches("!~", "r.*", "router")


def test_variable_queries_are_the_selectors_of_label_values():
    dashboard = {
        "templating": {
            "list": [
                {"type": "datasource", "query": "prometheus"},
                {"type": "query", "name": "ns", "query": {"query": "label_values(up, namespace)"}},
                {"type": "query", "name": "role", "query": 'label_values(x_total{namespace=~"$ns"}, role)'},
            ]
        }
    }
    assert list(variable_queries(dashboard)) == ["up", 'x_total{namespace=~"$ns"}']
    with pytest.raises(ValueError, match="only label_values"):
        list(variable_queries({"templating": {"list": [{"type": "query", "name": "v", "query": "query_result(up)"}]}}))
