"""A role whose TP group spans pods (`prefill.nodes` / `decode.nodes` > 1): a LeaderWorkerSet whose leader
runs node-rank 0 and serves HTTP, whose workers take their node-rank from LWS_WORKER_INDEX, both meeting at
LWS_LEADER_ADDRESS; tpSize / nodes GPUs per pod; the Service and the HPA aim at the leaders; the schema
refuses a tpSize that is not a multiple of nodes. kubernetes-validate knows no LeaderWorkerSet (a CRD): its
two pod templates are validated as PodTemplates, every other object as itself."""

from __future__ import annotations

import argparse

import helm_python
import pytest
from kubernetes_validate import validate
from kubernetes_validate.utils import latest_version

from common.config import ServerConfig
from tandem.flags import add_model_flags
from tests.helm.chart import component, flag, notes, objects, render

VALUES = {"device": "cuda", "prefill": {"replicas": 2, "tpSize": 4, "nodes": 2}}
LEADER_ENV = {"LWS_LEADER_ADDRESS": "demo-tandem-prefill-0.demo-tandem-prefill.llm", "LWS_WORKER_INDEX": "0"}


def templates(docs: list[dict]) -> dict[str, dict]:
    lws = component(docs, "LeaderWorkerSet", "prefill")["spec"]["leaderWorkerTemplate"]
    return {"leader": lws["leaderTemplate"], "worker": lws["workerTemplate"]}


def as_launched(args: list[str], env: dict[str, str]) -> ServerConfig:
    """The args as the kubelet expands $(VAR) from the pod's env, through `tandem serve`'s own flags and
    checks."""
    for name, value in env.items():
        args = [a.replace(f"$({name})", value) for a in args]
    parser = argparse.ArgumentParser()
    add_model_flags(parser, ServerConfig)
    return ServerConfig(**vars(parser.parse_args(args[1:])))


def test_a_group_of_pods_per_replica_with_the_node_flags():
    docs = render(VALUES)
    lws = component(docs, "LeaderWorkerSet", "prefill")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert [d["metadata"]["name"] for d in objects(docs, "Deployment")] == ["demo-tandem-decode", "demo-tandem-router"]
    pods = templates(docs)
    for node, env in (("leader", LEADER_ENV), ("worker", LEADER_ENV | {"LWS_WORKER_INDEX": "1"})):
        c = pods[node]["spec"]["containers"][0]
        assert flag(c["args"], "--dist-init-addr") == "$(LWS_LEADER_ADDRESS):5000"
        assert flag(c["args"], "--node-rank") == {"leader": "0", "worker": "$(LWS_WORKER_INDEX)"}[node]
        config = as_launched(c["args"], env)
        assert (config.tp_size, config.nnodes, config.node_rank) == (4, 2, int(env["LWS_WORKER_INDEX"]))
        assert config.disaggregation_mode == "prefill"
        assert config.dist_init_addr == f"{LEADER_ENV['LWS_LEADER_ADDRESS']}:5000"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2  # tpSize / nodes
    leader, worker = (pods[n]["spec"]["containers"][0] for n in ("leader", "worker"))
    assert {p["name"]: p["containerPort"] for p in leader["ports"]} == {
        "http": 30000,
        "bootstrap": 8998,
        "dist-init": 5000,
    }
    assert "livenessProbe" in leader and not {"ports", "livenessProbe", "readinessProbe", "startupProbe"} & set(worker)


def test_the_service_and_the_autoscaler_aim_at_the_leaders():
    docs = render(VALUES | {"prefill": VALUES["prefill"] | {"autoscaling": {"enabled": True}}})
    selector = component(docs, "Service", "prefill")["spec"]["selector"]
    assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert "leaderworkerset.sigs.k8s.io/worker-index" not in component(docs, "Service", "decode")["spec"]["selector"]
    target = component(docs, "HorizontalPodAutoscaler", "prefill")["spec"]["scaleTargetRef"]
    assert target == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "demo-tandem-prefill",
    }
    assert "replicas" not in component(docs, "LeaderWorkerSet", "prefill")["spec"]


def test_every_object_and_pod_template_is_valid():
    docs = render(VALUES)
    for doc in docs:
        if doc["kind"] != "LeaderWorkerSet":
            validate(doc, latest_version(), strict=True)
    for node, template in templates(docs).items():
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": node}, "template": template}
        validate(pod, latest_version(), strict=True)


@pytest.mark.parametrize(
    ("role", "where", "says"),
    [
        ({"tpSize": 3, "nodes": 2}, "/prefill/tpSize", "multipleOf: got 3, want 2"),
        ({"nodes": 2}, "/prefill/tpSize", "multipleOf: got 1, want 2"),
        ({"tpSize": 4, "nodes": 0}, "/prefill/nodes", "minimum: got 0, want 1"),
    ],
)
def test_the_schema_refuses_a_tp_size_the_nodes_cannot_split(role, where, says):
    with pytest.raises(helm_python.HelmValuesError) as e:
        render({"prefill": {"replicas": 1, **role}})
    assert f"at '{where}': " in str(e.value) and says in str(e.value), str(e.value)


def test_the_notes_say_what_a_group_is_and_what_it_needs():
    assert "prefill: a LeaderWorkerSet, each server one group of 2 pods" in notes(VALUES)
    assert "LeaderWorkerSet" not in notes()
