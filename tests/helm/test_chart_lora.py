"""lora.enabled: every prefill and decode serves the same adapters (a decode must hold its prefill's adapter), read
from one volume mounted read-only on every engine pod: the rendered `tandem serve` flags exactly, as the CLI reads
them; the volume (a PVC or a node directory) and its mounts; the schema turning wrong values away naming the key;
and the chart's own flags that the servers refuse with LoRA refused by the chart too (each refusal checked
against the server's own). Off by default."""

from __future__ import annotations

import helm_python
import pytest

from tests.helm.chart import component, container, notes, parse_serve, render
from tests.helm.crd import validate_objects

ADAPTERS = [{"name": "sql", "path": "sql-lora"}, {"name": "support.v2", "path": "/tenants/support/"}]
PVC = {
    "enabled": True,
    "adapters": ADAPTERS,
    "pvc": {"claimName": "adapters"},
    "maxLorasPerBatch": 4,
    "maxLoraRank": 64,
    "targetModules": ["q_proj", "v_proj"],
}
HOST = {"enabled": True, "source": "hostPath", "hostPath": {"path": "/mnt/adapters"}, "mountPath": "/lora"}
FLAGS = [
    "--enable-lora",
    "--lora-paths",
    "sql=/adapters/sql-lora",
    "support.v2=/adapters/tenants/support",
    "--max-loras-per-batch",
    "4",
    "--max-lora-rank",
    "64",
    "--lora-target-modules",
    "q_proj",
    "v_proj",
]


@pytest.fixture(scope="module")
def pvc() -> list[dict]:
    return render({"device": "cpu", "lora": PVC})


@pytest.fixture(scope="module")
def host() -> list[dict]:
    return render({"lora": HOST})


def lora_flags(args: list[str]) -> list[str]:
    """The LoRA flags, from --enable-lora to the end of the chart's own (no extraArgs here)."""
    return args[args.index("--enable-lora") :]


def pod(docs: list[dict], role: str) -> dict:
    return component(docs, "Deployment", role)["spec"]["template"]["spec"]


def test_both_roles_serve_the_same_adapters_with_exactly_these_flags(pvc):
    for role in ("prefill", "decode"):
        args = container(pvc, role)["args"]
        assert lora_flags(args) == FLAGS
        config = parse_serve(args)
        assert config.enable_lora and config.lora_paths == FLAGS[2:4]
        assert (config.max_loras_per_batch, config.max_lora_rank, config.lora_target_modules) == (
            4,
            64,
            ["q_proj", "v_proj"],
        )


def test_the_adapters_volume_is_mounted_read_only_on_every_engine_pod(pvc, host):
    for role in ("prefill", "decode"):
        spec = pod(pvc, role)
        assert {"name": "lora-adapters", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}} in spec[
            "volumes"
        ]
        mount = {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True}
        assert mount in spec["containers"][0]["volumeMounts"]
        spec = pod(host, role)
        assert {"name": "lora-adapters", "hostPath": {"path": "/mnt/adapters", "type": "Directory"}} in spec["volumes"]
        assert {"name": "lora-adapters", "mountPath": "/lora", "readOnly": True} in spec["containers"][0][
            "volumeMounts"
        ]
    assert "lora-adapters" not in str(pod(pvc, "router"))


def test_every_object_is_valid(pvc, host):
    validate_objects(pvc)
    validate_objects(host)


def test_without_adapters_only_lora_and_its_default_slots_are_given(host):
    args = container(host, "decode")["args"]
    assert lora_flags(args) == ["--enable-lora", "--max-loras-per-batch", "8"]
    config = parse_serve(args)
    assert config.enable_lora and config.lora_paths is None and config.max_lora_rank is None


def test_it_composes_with_the_gateway_the_sidecar_beside_an_adapter_serving_decode():
    docs = render({"lora": PVC, "gateway": {"enabled": True}})
    spec = pod(docs, "decode")
    assert lora_flags(spec["containers"][0]["args"]) == FLAGS
    assert [c["name"] for c in spec["initContainers"]] == ["pair-sidecar"]


@pytest.mark.parametrize(
    "values, where, says",
    [
        ({"enabled": True}, "/lora/pvc", "missing property 'claimName'"),
        ({"enabled": True, "source": "hostPath"}, "/lora/hostPath", "missing property 'path'"),
        ({"source": "nfs"}, "/lora/source", "value must be one of 'pvc', 'hostPath'"),
        ({"adapters": [{"name": "a=b", "path": "x"}]}, "/lora/adapters/0/name", "does not match pattern"),
        ({"adapters": [{"name": "a", "path": "x y"}]}, "/lora/adapters/0/path", "does not match pattern"),
        ({"adapters": [{"name": "a"}]}, "/lora/adapters/0", "missing property 'path'"),
        ({"maxLorasPerBatch": 0}, "/lora/maxLorasPerBatch", "minimum: got 0, want 1"),
        ({"targetModules": ["lm_head"]}, "/lora/targetModules/0", "value must be one of"),
        ({"mountPath": "adapters"}, "/lora/mountPath", "does not match pattern"),
    ],
)
def test_the_schema_rejects_wrong_values_naming_the_key(values, where, says):
    with pytest.raises(helm_python.HelmValuesError) as e:
        render({"lora": values})
    assert f"at '{where}': " in str(e.value) and says in str(e.value), str(e.value)


COMBINED = [  # values the chart turns into flags that `tandem serve --enable-lora` may refuse
    ({"decode": {"replicas": 1, "tpSize": 2}}, "set decode.tpSize=1"),
    ({"kvStore": {"enabled": True}}, "set kvStore.enabled=false"),
    ({"planner": {"enabled": True}}, "set planner.actuator=scale or none"),
]


def server_refusal(values: dict) -> str | None:
    """What `tandem serve` says of these values' decode flags with the LoRA flags added (None: it runs them)."""
    args = container(render({"device": "cpu", **values}), "decode")["args"]
    try:
        parse_serve(args + FLAGS)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("values, chart_says", COMBINED, ids=["tp", "kv-store", "flip"])
def test_the_chart_refuses_with_one_line_exactly_what_the_servers_refuse_with_lora(values, chart_says):
    """The chart's refusals follow the servers' (common/config_checks.py check_lora): one the servers lift fails here."""
    refused = server_refusal(values)
    if refused is None:
        render({"device": "cpu", "lora": PVC, **values})  # the chart must render it: drop its refusal (_lora.tpl)
        return
    assert "--enable-lora with" in refused
    with pytest.raises(helm_python.HelmError) as e:
        render({"device": "cpu", "lora": PVC, **values})
    assert "lora.enabled: the servers do not run LoRA" in str(e.value) and chart_says in str(e.value)


def test_the_notes_name_the_adapters():
    assert (
        'LoRA: 2 adapter(s) from the volume at /adapters sql support.v2; a request names one as its "model"'
        in notes({"lora": PVC})
    )
    assert "LoRA" not in notes()


def test_off_by_default():
    docs = render()
    for role in ("prefill", "decode"):
        assert "--enable-lora" not in container(docs, role)["args"] and "lora-adapters" not in str(pod(docs, role))
