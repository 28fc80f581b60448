"""The Grafana dashboard (dashboards/tandem.json) reads only series that Tandem's processes export, with
the role that exports them: a monolithic server, then a 1 prefill + 1 decode cluster with its router and
the prefill's embedded bootstrap registry (tiny model), each scraped after one request."""

from __future__ import annotations

import json

import httpx
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT
from tests.integration.cluster import generate, start_cluster
from tests.integration.tiny_model import random_prompts
from tests.promql import dashboard_queries, exported_series, matches, query_metric_names, selectors, variable_queries

DASHBOARD = ROOT / "dashboards" / "tandem.json"
SHIPPED = ROOT / "helm" / "tandem" / "dashboards" / "tandem.json"
FLAGS = ("--page-size", "4", "--chunked-prefill-size", "32")
PROMPT = random_prompts(1, 20, 20, seed=31)[0]
ENGINE_ROLES = {"null", "prefill", "decode"}  # the values of the dashboard's $role
# what Grafana puts in place of its variables before a query reaches Prometheus
GRAFANA_VALUES = {"$__rate_interval": "1m", "$namespace": ".*", "$role": "prefill"}


def scrape(url: str, role: str) -> set[tuple[str, str]]:
    """(series name, role) for every series the process at `url` exports; every sample must carry its role."""
    text = httpx.get(url + "/metrics", timeout=10).text
    roles = {s.labels.get("role") for f in text_string_to_metric_families(text) for s in f.samples}
    assert roles == {role}, f"{url}/metrics: samples labelled role={roles}, expected only {role}"
    return {(series, role) for series in exported_series(text)}


@pytest.fixture(scope="module")
def exported(tiny_model_dir, reference_servers) -> set[tuple[str, str]]:
    """What every kind of process exports (metric names: the monolithic server is test_soak.py's reference)."""
    mono = reference_servers.get("--model", str(tiny_model_dir), *FLAGS)
    generate(mono.url, PROMPT, 4)
    found = scrape(mono.url, "null")
    c = start_cluster("mooncake", flags=("--model", str(tiny_model_dir), *FLAGS))
    try:
        generate(c.url, PROMPT, 4)
        c.wait_idle()
        for url, role in (
            (c.prefills[0].url, "prefill"),
            (c.decodes[0].url, "decode"),
            (c.router.url, "router"),
            (f"http://127.0.0.1:{c.prefill_bootstrap_ports[0]}", "bootstrap"),
        ):
            found |= scrape(url, role)
    finally:
        c.stop()
    return found


def roles_selected(matchers: list[tuple[str, str, str]]) -> list[set[str]]:
    """For each value a dashboard variable in the role matcher can take, the process roles it selects."""
    role = [(op, value) for label, op, value in matchers if label == "role"]
    assert role, "every selector names the role it reads (role=... or role=~...)"
    op, value = role[0]
    every = ENGINE_ROLES | {"router", "bootstrap"}
    values = [value.replace("$role", r) for r in sorted(ENGINE_ROLES)] if "$role" in value else [value]
    return [{r for r in every if matches(op, v, r)} for v in values]


def test_the_chart_ships_the_repositorys_dashboard_byte_for_byte():
    assert SHIPPED.read_bytes() == DASHBOARD.read_bytes(), "copy dashboards/tandem.json to helm/tandem/dashboards/"


def test_every_query_is_promql_on_the_templated_datasource():
    dashboard = json.loads(DASHBOARD.read_text())
    for expr in [*dashboard_queries(dashboard), *variable_queries(dashboard)]:
        for variable, value in GRAFANA_VALUES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        promql_parser.parse(expr)  # raises on a syntax error
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert {json.dumps(p["datasource"]) for p in panels} == {json.dumps({"type": "prometheus", "uid": "${datasource}"})}
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_every_query_reads_series_that_the_role_it_names_exports(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    panel_queries, variables = list(dashboard_queries(dashboard)), list(variable_queries(dashboard))
    assert len(panel_queries) >= 40 and len(variables) == 2
    by_series: dict[str, set[str]] = {}
    for series, role in exported:
        by_series.setdefault(series, set()).add(role)
    problems = []
    for expr in panel_queries + variables:
        names = query_metric_names(expr)
        problems += [f"{name} (in {expr}) is exported by no process" for name in sorted(names - set(by_series))]
    for expr in panel_queries:
        for name, matchers in selectors(expr):
            for roles in roles_selected(matchers):
                if not roles & by_series.get(name, set()):
                    problems.append(
                        f"{name} with roles {sorted(roles)} (in {expr}): exported only by {sorted(by_series.get(name, []))}"
                    )
    assert problems == []


def test_the_role_variable_offers_the_engine_roles(exported):
    """$role repeats the engine row: label_values(tandem_requests_total, role) lists exactly the engine roles."""
    assert {role for series, role in exported if series == "tandem_requests_total"} == ENGINE_ROLES
    [role_var] = [v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["name"] == "role"]
    assert "tandem_requests_total" in role_var["query"]["query"]
    repeated = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p.get("repeat") == "role"]
    assert [p["type"] for p in repeated] == ["row"]
