"""gateway.enabled: behind a Gateway API inference gateway. The chart's InferencePool and HTTPRoute are valid by
the extension's and Gateway API's own CRD schemas (tests/helm/crd.py), every other object by kubernetes-validate;
and they are wired: the pool selects the decode pods (a LeaderWorkerSet's leaders) at their pair sidecar's port,
its endpoint picker is the EPP's Service at the EPP's gRPC port, the route's backend is the pool, the EPP finds
the workers with the router's own discovery flags, the sidecar runs beside each decode on its port, the EPP may
read the pool and watch pods and nothing else, and the NetworkPolicies let the EPP and the gateway in. Off by
default; with TLS refused."""

from __future__ import annotations

import copy

import helm_python
import jsonschema
import pytest

from tests.helm.chart import component, container, env_of, flag, notes, objects, render, service_host
from tests.helm.crd import validate_custom, validate_objects

KEY = {"apiKey": {"existingSecret": "tandem-api-key", "key": "api-key"}}
PLAIN = {"gateway": {"enabled": True}}
SPREAD = {  # a FailOpen pool of LWS decodes, a standalone registry, an API key, a route to another namespace
    "gateway": {
        "enabled": True,
        "failureMode": "FailOpen",
        "policy": "power_of_two",
        "sidecar": {"port": 8200, "from": [{"namespaceSelector": {"matchLabels": {"name": "gateways"}}}]},
        "httpRoute": {"gatewayNamespace": "gateways", "sectionName": "http", "requestTimeout": "10m"},
    },
    "decode": {"replicas": 2, "nodes": 2, "tpSize": 2},
    "bootstrap": {"standalone": {"enabled": True}},
    "auth": KEY,
}
SIDECAR_ARGS = ["sidecar", "--decode", "http://127.0.0.1:30000", "--host", "0.0.0.0", "--port", "8100"]


@pytest.fixture(scope="module")
def plain() -> list[dict]:
    return render(PLAIN)


@pytest.fixture(scope="module")
def spread() -> list[dict]:
    return render(SPREAD)


def pod_template(docs: list[dict], role: str, node: str = "") -> dict:
    if node:
        return component(docs, "LeaderWorkerSet", role)["spec"]["leaderWorkerTemplate"][f"{node}Template"]
    return component(docs, "Deployment", role)["spec"]["template"]


def sidecars(template: dict) -> list[dict]:
    return [c for c in template["spec"].get("initContainers", []) if c["name"] == "pair-sidecar"]


@pytest.mark.parametrize("which", ["plain", "spread"])
def test_every_object_is_valid_by_its_schema(which, request):
    docs = request.getfixturevalue(which)
    validate_objects(docs)
    kinds = {d["kind"] for d in docs}
    assert kinds >= {"InferencePool", "HTTPRoute", "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"}


@pytest.mark.parametrize(
    "kind, change, says",
    [
        ("InferencePool", lambda s: s.pop("targetPorts"), "'targetPorts' is a required property"),
        ("InferencePool", lambda s: s["endpointPickerRef"].update(failureMode="Open"), "'Open' is not one of"),
        ("InferencePool", lambda s: s["selector"].update(matchLabel={}), "'matchLabel' was unexpected"),
        ("InferencePool", lambda s: s["targetPorts"].append({"number": 0}), "0 is less than the minimum of 1"),
        ("HTTPRoute", lambda s: s["rules"][0]["backendRefs"][0].update(wieght=1), "'wieght' was unexpected"),
        ("HTTPRoute", lambda s: s["rules"][0]["matches"][0]["path"].update(type="Prefix"), "'Prefix' is not one of"),
    ],
)
def test_the_shipped_schemas_refuse_what_the_api_server_would(plain, kind, change, says):
    doc = copy.deepcopy(objects(plain, kind)[0])
    validate_custom(doc)
    change(doc["spec"])
    with pytest.raises(jsonschema.ValidationError, match=says):
        validate_custom(doc)


def test_the_pool_selects_the_decode_pods_at_their_sidecars_port(plain):
    pool = component(plain, "InferencePool", "pool")["spec"]
    selector = pool["selector"]["matchLabels"].items()
    assert selector <= pod_template(plain, "decode")["metadata"]["labels"].items()
    for other in ("prefill", "router", "epp"):
        assert not selector <= pod_template(plain, other)["metadata"]["labels"].items()
    (sidecar,) = sidecars(pod_template(plain, "decode"))
    assert pool["targetPorts"] == [{"number": 8100}] and pool["appProtocol"] == "http"
    assert sidecar["ports"] == [{"name": "pair", "containerPort": 8100}] and flag(sidecar["args"], "--port") == "8100"


def test_the_pool_of_a_leader_worker_set_selects_its_leaders_which_run_the_sidecar(spread):
    selector = component(spread, "InferencePool", "pool")["spec"]["selector"]["matchLabels"]
    leader, worker = pod_template(spread, "decode", "leader"), pod_template(spread, "decode", "worker")
    assert selector.pop("leaderworkerset.sigs.k8s.io/worker-index") == "0"  # LWS labels a group's leader 0
    assert selector.items() <= leader["metadata"]["labels"].items()
    assert len(sidecars(leader)) == 1 and sidecars(worker) == []
    assert component(spread, "InferencePool", "pool")["spec"]["targetPorts"] == [{"number": 8200}]


@pytest.mark.parametrize("which", ["plain", "spread"])
def test_the_pools_endpoint_picker_is_the_epp_service_at_its_grpc_port(which, request):
    docs = request.getfixturevalue(which)
    ref = component(docs, "InferencePool", "pool")["spec"]["endpointPickerRef"]
    svc = component(docs, "Service", "epp")
    epp = pod_template(docs, "epp")
    c = epp["spec"]["containers"][0]
    port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert (ref["group"], ref["kind"], ref["name"]) == ("", "Service", svc["metadata"]["name"])
    assert ref["failureMode"] == {"plain": "FailClose", "spread": "FailOpen"}[which]
    assert port == {"name": "grpc-ext-proc", "port": 9002, "targetPort": "grpc"}
    assert {"name": "grpc", "containerPort": 9002} in c["ports"] and flag(c["args"], "--grpc-port") == "9002"
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["selector"].items() <= epp["metadata"]["labels"].items()


def test_the_route_sends_the_gateways_requests_to_the_pool(plain, spread):
    route = component(plain, "HTTPRoute", "route")["spec"]
    pool = component(plain, "InferencePool", "pool")
    assert route["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway"}
    ]
    (rule,) = route["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}] and rule["timeouts"] == {
        "request": "300s"
    }
    route = component(spread, "HTTPRoute", "route")["spec"]
    assert route["parentRefs"][0] == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": "inference-gateway",
        "namespace": "gateways",
        "sectionName": "http",
    }
    assert route["rules"][0]["timeouts"] == {"request": "10m"}
    no_route = render({"gateway": {"enabled": True, "httpRoute": {"enabled": False}}})
    assert objects(no_route, "HTTPRoute") == [] and len(objects(no_route, "InferencePool")) == 1


ROUTERS = ("--prefill-discovery", "--discovery-interval-s", "--prefill-bootstrap-port")  # the router's values


@pytest.mark.parametrize("which", ["plain", "spread"])
def test_the_epp_finds_the_workers_with_the_routers_discovery_flags(which, request):
    """The prefills as the router finds them; the decodes at their sidecar's port, the pool's endpoints."""
    docs = request.getfixturevalue(which)
    epp, router = container(docs, "epp"), container(docs, "router")
    policy, sidecar = {"plain": ("cache_aware", 8100), "spread": ("power_of_two", 8200)}[which]
    head = ["epp", "--host", "0.0.0.0", "--grpc-port", "9002", "--port", "8080", "--policy", policy]
    assert epp["command"] == ["tandem"] and epp["args"][: len(head)] == head
    flags = ROUTERS + (("--prefill-bootstrap-host",) if which == "spread" else ())
    assert {f: flag(epp["args"], f) for f in flags} == {f: flag(router["args"], f) for f in flags}
    assert flag(epp["args"], "--decode-discovery") == f"{service_host('decode')}:{sidecar}"
    assert len(epp["args"]) == len(head) + 2 * (len(flags) + 1)
    assert {"name": "http", "containerPort": int(flag(epp["args"], "--port"))} in epp["ports"]
    assert (epp["readinessProbe"]["httpGet"], epp["livenessProbe"]["httpGet"]) == (
        {"path": "/readiness", "port": "http"},
        {"path": "/health", "port": "http"},
    )
    key = {"secretKeyRef": {"name": "tandem-api-key", "key": "api-key"}}
    assert env_of(epp) == (
        {"TANDEM_EPP_WORKER_API_KEY": {"name": "TANDEM_EPP_WORKER_API_KEY", "valueFrom": key}}
        if which == "spread"
        else {}
    )


@pytest.mark.parametrize("which", ["plain", "spread"])
def test_the_epp_cli_reads_the_rendered_command(which, request):
    """Through `tandem epp`'s own parser and config (issue 54's EPP; skipped on a tree without it)."""
    epp_cli = pytest.importorskip("tandem.epp_cli", reason="`tandem epp` is not in this tree")
    from router.epp.config import EppConfig

    args = container(request.getfixturevalue(which), "epp")["args"]
    assert args[0] == "epp"
    config = EppConfig(**vars(epp_cli.epp_parser().parse_args(args[1:])))
    assert config.pd and (config.grpc_port, config.port, config.host) == (9002, 8080, "0.0.0.0")
    assert config.decode_discovery == f"{service_host('decode')}:{8100 if which == 'plain' else 8200}"


def test_the_sidecar_runs_beside_each_decode_until_it_has_drained(plain, spread):
    decode = pod_template(plain, "decode")["spec"]
    (sidecar,) = sidecars(pod_template(plain, "decode"))
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: stopped after the decode container exits
    assert sidecar["command"] == ["tandem"] and sidecar["args"] == SIDECAR_ARGS
    assert flag(decode["containers"][0]["args"], "--port") == "30000"  # what --decode names on 127.0.0.1
    assert sidecar["image"] == decode["containers"][0]["image"] and "env" not in sidecar
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/health", "port": "pair"}
    assert sidecars(pod_template(plain, "prefill")) == []
    (sidecar,) = sidecars(pod_template(spread, "decode", "leader"))
    assert sidecar["args"] == [*SIDECAR_ARGS[:-1], "8200"]
    assert env_of(sidecar)["TANDEM_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "tandem-api-key", "key": "api-key"}
    }


def test_the_epp_may_read_the_pool_and_watch_pods_and_nothing_else(plain):
    account, role, binding = (component(plain, k, "epp") for k in ("ServiceAccount", "Role", "RoleBinding"))
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    name = account["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "llm"}]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert pod_template(plain, "epp")["spec"]["serviceAccountName"] == name and account["automountServiceAccountToken"]
    assert objects(plain, "ClusterRole") == [] and objects(plain, "ClusterRoleBinding") == []


def test_the_policies_let_the_epp_reach_the_engines_and_the_gateway_reach_the_sidecars(plain, spread):
    epp = {"podSelector": {"matchLabels": component(plain, "Deployment", "epp")["spec"]["selector"]["matchLabels"]}}
    for role in ("prefill", "decode"):
        http = component(plain, "NetworkPolicy", role)["spec"]["ingress"][0]
        assert http["ports"] == [{"port": "http"}] and epp in http["from"]
    rules = component(plain, "NetworkPolicy", "decode")["spec"]["ingress"]
    assert {"ports": [{"port": 8100}]} in rules  # from anywhere: the gateway's namespace is the user's
    assert not [r for r in component(plain, "NetworkPolicy", "prefill")["spec"]["ingress"] if "from" not in r]
    rules = component(spread, "NetworkPolicy", "decode")["spec"]["ingress"]
    assert {"ports": [{"port": 8200}], "from": [*SPREAD["gateway"]["sidecar"]["from"], epp]} in rules


def test_the_notes_name_the_pool_its_picker_and_the_route():
    said = notes(PLAIN)
    assert (
        "the InferencePool demo-tandem-pool (its endpoint picker: the Service demo-tandem-epp:9002, failureMode" in said
    )
    assert "attached to the Gateway inference-gateway by the HTTPRoute demo-tandem-route" in said
    assert "InferencePool" not in notes()


def test_off_by_default():
    docs = render()
    assert not {"InferencePool", "HTTPRoute", "Role", "ServiceAccount"} & {d["kind"] for d in docs}
    assert sidecars(pod_template(docs, "decode")) == []
    for rule in component(docs, "NetworkPolicy", "decode")["spec"]["ingress"]:
        assert "epp" not in str(rule) and "from" in rule


@pytest.mark.parametrize(
    "values, where, says",
    [
        ({"failureMode": "Open"}, "/gateway/failureMode", "value must be one of 'FailClose', 'FailOpen'"),
        ({"policy": "fastest"}, "/gateway/policy", "value must be one of"),
        ({"sidecar": {"port": 0}}, "/gateway/sidecar/port", "minimum: got 0, want 1"),
        ({"httpRoute": {"pathPrefix": "v1"}}, "/gateway/httpRoute/pathPrefix", "does not match pattern"),
        ({"httpRoute": {"requestTimeout": "5 minutes"}}, "/gateway/httpRoute/requestTimeout", "does not match"),
        ({"grpcport": 9002}, "/gateway", "additional properties 'grpcport' not allowed"),
    ],
)
def test_the_schema_rejects_wrong_values_naming_the_key(values, where, says):
    with pytest.raises(helm_python.HelmValuesError) as e:
        render({"gateway": {"enabled": True, **values}})
    assert f"at '{where}': " in str(e.value) and says in str(e.value), str(e.value)


def test_tls_is_refused_with_one_line():
    values = {**PLAIN, "tls": {"enabled": True, "secretName": "t"}, "bootstrap": {"standalone": {"enabled": True}}}
    with pytest.raises(helm_python.HelmError) as e:
        render(values)
    assert "gateway.enabled: the EPP and the pair sidecar do not speak TLS" in str(e.value)
