"""planner.enabled: the chart runs `tandem planner` against the router's Service, with its flags as the CLI reads
them; actuator flip makes every engine switchable (--enable-pd-role-switch, a bootstrap port on decodes too);
actuator scale grants its ServiceAccount get/patch on the two Deployments' scale and nothing else, and refuses an
HPA on the same Deployments; the engines admit it to their HTTP port (/metrics). Off by default."""

from __future__ import annotations

import argparse

import pytest
from kubernetes_validate import validate
from kubernetes_validate.utils import latest_version

from planner.config import PlannerConfig
from tandem.flags import add_model_flags
from tests.helm.chart import component, container, flag, objects, render, service_host


def parse_planner(args: list[str]) -> PlannerConfig:
    assert args[0] == "planner", args
    parser = argparse.ArgumentParser()
    add_model_flags(parser, PlannerConfig)
    return PlannerConfig(**vars(parser.parse_args(args[1:])))


def test_flip_runs_the_planner_on_the_router_and_makes_every_engine_switchable():
    docs = render({"planner": {"enabled": True, "mode": "sla", "ttftMs": 500, "itlMs": 40}})
    for kind in ("Deployment", "ServiceAccount"):
        validate(component(docs, kind, "planner"), latest_version(), strict=True)
    config = parse_planner(container(docs, "planner")["args"])
    assert config.router == f"http://{service_host('router')}:8000"
    assert (config.mode, config.ttft_ms, config.itl_ms, config.actuator) == ("sla", 500, 40, "flip")
    assert not component(docs, "ServiceAccount", "planner")["automountServiceAccountToken"]
    assert not [d for d in objects(docs, "Role") + objects(docs, "RoleBinding")]
    for role in ("prefill", "decode"):
        args = container(docs, role)["args"]
        assert "--enable-pd-role-switch" in args and flag(args, "--bootstrap-port") == "8998"
    for role in ("prefill", "decode"):
        http = component(docs, "NetworkPolicy", role)["spec"]["ingress"][0]
        selected = {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in http["from"]}
        assert selected == {"router", "planner"}


def test_scale_grants_only_the_two_deployments_scale():
    docs = render({"planner": {"enabled": True, "actuator": "scale", "maxDecode": 6}})
    role, binding = component(docs, "Role", "planner"), component(docs, "RoleBinding", "planner")
    for obj in (role, binding, component(docs, "Deployment", "planner")):
        validate(obj, latest_version(), strict=True)
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["demo-tandem-prefill", "demo-tandem-decode"],
            "verbs": ["get", "patch"],
        }
    ]
    assert binding["subjects"][0]["name"] == component(docs, "ServiceAccount", "planner")["metadata"]["name"]
    assert component(docs, "ServiceAccount", "planner")["automountServiceAccountToken"]
    config = parse_planner(container(docs, "planner")["args"])
    assert (config.actuator, config.namespace, config.max_decode) == ("scale", "llm", 6)
    assert (config.prefill_deployment, config.decode_deployment) == ("demo-tandem-prefill", "demo-tandem-decode")
    assert "--enable-pd-role-switch" not in container(docs, "decode")["args"]


@pytest.mark.parametrize(
    "values, words",
    [
        ({"planner": {"enabled": True, "actuator": "scale"}, "prefill": {"autoscaling": {"enabled": True}}}, "HPA"),
        (
            {
                "planner": {"enabled": True},
                "tls": {"enabled": True, "secretName": "t"},
                "bootstrap": {"standalone": {"enabled": True}},
            },
            "TLS",
        ),
    ],
)
def test_combinations_it_cannot_serve_are_refused(values, words):
    with pytest.raises(Exception, match=words):
        render(values)


def test_off_by_default():
    docs = render()
    assert not [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "planner"]
    assert "--enable-pd-role-switch" not in container(docs, "prefill")["args"]
