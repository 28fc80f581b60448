"""The chart's security settings rendered by Helm and validated (kubernetes-validate, strict): the API key
on the router and every engine pod from one Secret; the NetworkPolicies (on by default) admitting only the
router to the engines' HTTP port, the engines to each other and Prometheus to /metrics; TLS with the
certificate Secret mounted and the flags set on every server, the router included (it calls the pods over
HTTPS), with the policy and TLS each on and off."""

from __future__ import annotations

import helm_python
import pytest
from kubernetes_validate import validate
from kubernetes_validate.utils import latest_version

from router.discovery import targets_from_config
from tests.helm.chart import (
    component,
    container,
    env_of,
    example,
    objects,
    parse_router,
    parse_serve,
    render,
    service_host,
)

CRD_KINDS = {"ServiceMonitor", "PodMonitor"}
TLS = {"enabled": True, "secretName": "tandem-tls"}
KEY = {"apiKey": {"existingSecret": "tandem-api-key", "key": "api-key"}}
PROMETHEUS = [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


def labels(name: str) -> dict:
    return {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": name,
    }


def pods(*names: str) -> list[dict]:
    return [{"podSelector": {"matchLabels": labels(n)}} for n in names]


@pytest.mark.parametrize("standalone", [False, True], ids=["embedded-bootstrap", "standalone-bootstrap"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("policy", [False, True], ids=["no-policy", "policy"])
def test_policy_and_tls_on_and_off_render_valid_objects(policy, tls, standalone):
    values = {
        "networkPolicy": {"enabled": policy},
        "tls": TLS if tls else {"enabled": False},
        "bootstrap": {"standalone": {"enabled": standalone}},
        "auth": KEY,
    }
    if tls and not standalone:  # decodes would reach a prefill pod's registry by address: no certificate names it
        with pytest.raises(helm_python.HelmValuesError, match="at '/bootstrap/standalone/enabled'"):
            render(values)
        return
    docs = render(values)
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            validate(doc, latest_version(), strict=True)
    policies = {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in objects(docs, "NetworkPolicy")}
    assert policies == (({"prefill", "decode"} | ({"bootstrap"} if standalone else set())) if policy else set())


def test_the_policy_is_on_by_default_and_admits_exactly_router_engines_and_prometheus():
    docs = render()
    for name in ("prefill", "decode"):
        spec = component(docs, "NetworkPolicy", name)["spec"]
        assert spec["podSelector"] == {"matchLabels": labels(name)} and spec["policyTypes"] == ["Ingress"]
        assert spec["ingress"] == [
            {"from": pods("router"), "ports": [{"port": "http"}]},
            {"from": pods("prefill", "decode")},  # control and data ports are picked at start-up
            {"from": PROMETHEUS, "ports": [{"port": "http"}]},
        ]


def test_the_standalone_bootstrap_admits_the_engines_and_prometheus_on_its_port():
    docs = render({"bootstrap": {"standalone": {"enabled": True}}, "networkPolicy": {"metricsFrom": []}})
    assert component(docs, "NetworkPolicy", "bootstrap")["spec"]["ingress"] == [
        {"from": pods("prefill", "decode"), "ports": [{"port": "bootstrap"}]}
    ]
    rule = {"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"port": 9000}]}
    docs = render({"networkPolicy": {"extraIngress": [rule]}})
    assert component(docs, "NetworkPolicy", "decode")["spec"]["ingress"][-1] == rule


def test_the_api_key_reaches_the_router_and_every_engine_pod_from_one_secret():
    docs = render({"auth": KEY})
    ref = {"secretKeyRef": {"name": "tandem-api-key", "key": "api-key"}}
    for name in ("router", "prefill", "decode"):
        assert env_of(container(docs, name))["TANDEM_API_KEY"]["valueFrom"] == ref, name
    for name in ("router", "prefill", "decode"):
        assert "TANDEM_API_KEY" not in env_of(container(render(), name))  # no key: none set


def test_tls_mounts_the_certificate_secret_and_sets_the_flags_on_every_server():
    docs = render({"tls": TLS, "bootstrap": {"standalone": {"enabled": True}}})
    for name in ("prefill", "decode"):
        c = container(docs, name)
        config = parse_serve(c["args"])
        assert (config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs) == (
            "/etc/tandem/tls/tls.crt",
            "/etc/tandem/tls/tls.key",
            "/etc/tandem/tls/ca.crt",
        )
        assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in c["volumeMounts"]
        spec = component(docs, "Deployment", name)["spec"]["template"]["spec"]
        assert {"name": "tls", "secret": {"secretName": "tandem-tls"}} in spec["volumes"]
        assert {c[p]["httpGet"]["scheme"] for p in ("startupProbe", "livenessProbe", "readinessProbe")} == {"HTTPS"}
    assert parse_serve(container(docs, "prefill")["args"]).bootstrap_url.startswith("https://demo-tandem-bootstrap.")
    boot = container(docs, "bootstrap")
    assert boot["args"][-4:] == [
        "--ssl-certfile",
        "/etc/tandem/tls/tls.crt",
        "--ssl-keyfile",
        "/etc/tandem/tls/tls.key",
    ]
    assert boot["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


def test_tls_gives_the_router_its_certificate_and_the_ca_so_it_calls_the_pods_over_https():
    docs = render({"tls": TLS, "bootstrap": {"standalone": {"enabled": True}}})
    router = container(docs, "router")
    config = parse_router(router["args"])
    assert (config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs) == (
        "/etc/tandem/tls/tls.crt",
        "/etc/tandem/tls/tls.key",
        "/etc/tandem/tls/ca.crt",
    )
    # discovered pods are https://<pod address>, each verified against its Service's name
    assert [(t.role, t.host, t.tls) for t in targets_from_config(config)] == [
        ("prefill", service_host("prefill"), True),
        ("decode", service_host("decode"), True),
    ]
    assert targets_from_config(config)[0].url("10.1.2.3") == "https://10.1.2.3:30000"
    assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in router["volumeMounts"]
    spec = component(docs, "Deployment", "router")["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "tandem-tls"}} in spec["volumes"]
    assert {router[p]["httpGet"]["scheme"] for p in ("startupProbe", "livenessProbe", "readinessProbe")} == {"HTTPS"}
    plain = container(render(), "router")
    assert parse_router(plain["args"]).ssl_ca_certs is None and "volumeMounts" not in plain
    assert {plain[p]["httpGet"]["scheme"] for p in ("startupProbe", "livenessProbe", "readinessProbe")} == {"HTTP"}


def test_tls_without_the_ca_is_refused_naming_the_key():
    """The router cannot verify the pods without it."""
    with pytest.raises(helm_python.HelmValuesError, match="at '/tls/caKey'"):
        render({"tls": TLS | {"caKey": ""}, "bootstrap": {"standalone": {"enabled": True}}})


def test_the_tls_example_renders_keyed_encrypted_and_fenced():
    docs = render(example("gpu-tls-keyed.yaml"))
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in objects(docs, "NetworkPolicy")} == {
        "prefill",
        "decode",
        "bootstrap",
    }
    for name in ("prefill", "decode"):
        assert parse_serve(container(docs, name)["args"]).ssl_certfile == "/etc/tandem/tls/tls.crt"
        assert "TANDEM_API_KEY" in env_of(container(docs, name))


def test_tls_without_a_secret_is_refused_naming_the_key():
    with pytest.raises(helm_python.HelmValuesError) as e:
        render({"tls": {"enabled": True}})
    assert "at '/tls/secretName': " in str(e.value), str(e.value)
