"""kvStore.enabled: the chart deploys a Mooncake Store (`tandem kv-store`, a Deployment and a Service whose
ports are the master's), points every engine at it through the Service, and admits only the engines (every
port: the store's memory is read over a transfer engine port picked at start-up) and Prometheus to it. The
rendered kv-store container, run as a local process, serves a store."""

from __future__ import annotations

import json

import httpx
from kubernetes_validate import validate
from kubernetes_validate.utils import latest_version

from tests.conftest import ServerProcess, free_port
from tests.helm.chart import component, container, flag, parse_serve, render, service_host
from tests.helm.pods import localize

ON = {"kvStore": {"enabled": True, "size": "64MB", "prefetchPolicy": "wait_complete"}}


def test_the_store_is_a_deployment_and_a_service_every_engine_is_pointed_at():
    docs = render(ON)
    for kind in ("Deployment", "Service", "NetworkPolicy"):
        validate(component(docs, kind, "kv-store"), latest_version(), strict=True)
    c = container(docs, "kv-store")
    assert c["args"][0] == "kv-store" and flag(c["args"], "--advertise-host") == "$(POD_IP)"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"master": 50051, "metadata": 8080, "metrics": 9003}
    svc = component(docs, "Service", "kv-store")["spec"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["ports"]} == {n: (v, n) for n, v in ports.items()}
    assert c["readinessProbe"]["httpGet"] == {"path": "/get_all_segments", "port": "metrics"}
    host = service_host("kv-store")
    for role in ("prefill", "decode"):
        config = parse_serve(container(docs, role)["args"])
        assert config.enable_hierarchical_cache and config.hicache_storage_backend == "mooncake"
        assert json.loads(config.hicache_storage_backend_extra_config) == {
            "master_server_address": f"{host}:50051",
            "metadata_server": f"http://{host}:8080/metadata",
        }
        assert config.hicache_storage_prefetch_policy == "wait_complete"
    rules = component(docs, "NetworkPolicy", "kv-store")["spec"]["ingress"]
    assert [r.get("ports") for r in rules] == [None, [{"port": "metrics"}]]
    assert {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in rules[0]["from"]} == {
        "prefill",
        "decode",
    }


def test_without_it_there_is_no_store_and_no_engine_flag():
    docs = render()
    assert not [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "kv-store"]
    assert parse_serve(container(docs, "prefill")["args"]).hicache_storage_backend is None


def test_the_rendered_store_container_serves_a_store():
    c = container(render(ON), "kv-store")
    ports = {flag: str(free_port()) for flag in ("--port", "--metadata-port", "--metrics-port", "--client-port")}
    args = localize(c["args"], {"--host": "127.0.0.1", "--advertise-host": "127.0.0.1", **ports})
    store = ServerProcess(args, int(ports["--metrics-port"]), name="chart-kv-store", health="/get_all_segments")
    try:
        store.wait_ready(60)
        assert httpx.get(f"{store.url}/health", timeout=5).json()["status"] == "ok"
    finally:
        store.stop()
