"""The Grafana dashboard ConfigMap (only when the chart carries a dashboard) and NOTES.txt."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helm.chart import CHART, ROOT, notes, objects, render

DASHBOARD = {"title": "Tandem", "panels": [{"type": "timeseries", "targets": [{"expr": "tandem_num_running_reqs"}]}]}
ENABLED = {"metrics": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}}}


@pytest.fixture
def chart_copy(tmp_path):
    copy = tmp_path / "tandem"
    shutil.copytree(CHART, copy)
    shutil.rmtree(copy / "dashboards", ignore_errors=True)
    return copy


def test_the_dashboard_ships_as_a_configmap_for_grafanas_sidecar(chart_copy):
    (chart_copy / "dashboards").mkdir()
    (chart_copy / "dashboards" / "tandem.json").write_text(json.dumps(DASHBOARD, indent=2) + "\n")
    [cm] = objects(render(ENABLED, chart_copy), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "monitoring"
    assert json.loads(cm["data"]["tandem.json"]) == DASHBOARD
    assert objects(render(None, chart_copy), "ConfigMap") == []  # off unless asked for


def test_no_dashboard_in_the_chart_renders_nothing(chart_copy):
    assert objects(render(ENABLED, chart_copy), "ConfigMap") == []


def test_the_charts_dashboard_is_the_repositorys():
    repo = ROOT / "dashboards" / "tandem.json"
    if not repo.exists():
        pytest.skip("the repository has no dashboards/tandem.json")
    shipped = CHART / "dashboards" / "tandem.json"
    assert shipped.exists(), (
        "copy dashboards/tandem.json to helm/tandem/dashboards/ (Helm reads files inside the chart only)"
    )
    assert json.loads(shipped.read_text()) == json.loads(repo.read_text())


def test_notes_tell_how_to_reach_the_endpoint_and_send_a_first_request():
    text = notes()
    assert "kubectl -n llm port-forward svc/demo-tandem-router 8000:8000" in text
    assert "curl $TANDEM_URL/v1/chat/completions -H 'Content-Type: application/json'" in text
    assert "http://demo-tandem-router.llm.svc.cluster.local:8000" in text and "Bearer" not in text
    with_key = notes(
        {"auth": {"apiKey": {"existingSecret": "keys", "key": "k"}}, "router": {"service": {"type": "LoadBalancer"}}}
    )
    assert "Authorization: Bearer $(kubectl -n llm get secret keys -o jsonpath='{.data.k}' | base64 -d)" in with_key
    assert "status.loadBalancer.ingress[0].ip" in with_key
