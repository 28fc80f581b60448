"""Every example rendered by Helm: valid Kubernetes objects (kubernetes-validate, strict) whose
commands the Tandem CLI itself accepts, and the facts that make a cluster work."""

from __future__ import annotations

import pytest

from tests.helm.chart import (
    EXAMPLES,
    component,
    container,
    env_of,
    example,
    flag,
    objects,
    parse_router,
    parse_serve,
    render,
    secret_value,
    service_host,
)
from tests.helm.crd import validate_objects


@pytest.mark.parametrize("values_file", EXAMPLES, ids=lambda p: p.name)
def test_every_object_is_valid_for_a_current_kubernetes(values_file):
    docs = render(example(values_file.name))
    validate_objects(docs)  # raises, naming the field, on anything invalid
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "Secret", "PodDisruptionBudget"}


@pytest.mark.parametrize("values_file", EXAMPLES, ids=lambda p: p.name)
def test_the_cli_accepts_every_rendered_command(values_file):
    values = example(values_file.name)
    docs = render(values)
    for role in ("prefill", "decode"):
        c = container(docs, role)
        config = parse_serve(c["args"])
        assert c["command"] == ["tandem"] and config.disaggregation_mode == role
        assert config.transfer_backend == values["transfer"]["backend"] and config.device == values["device"]
        assert config.host == "0.0.0.0" and c["ports"][0] == {"name": "http", "containerPort": config.port}
    router = parse_router(container(docs, "router")["args"])
    assert router.host == "0.0.0.0" and router.prefill == [] and router.decode == []
    assert router.prefill_discovery == f"{service_host('prefill')}:30000"
    assert router.decode_discovery == f"{service_host('decode')}:30000" and router.prefill_bootstrap_port == 8998


@pytest.mark.parametrize("values_file", EXAMPLES, ids=lambda p: p.name)
def test_services_probes_and_ports_line_up(values_file):
    values = example(values_file.name)
    docs = render(values)
    scheme = "HTTPS" if values.get("tls", {}).get("enabled") else "HTTP"
    for role in ("prefill", "decode"):
        pod = component(docs, "Deployment", role)["spec"]["template"]
        svc = component(docs, "Service", role)["spec"]
        c = pod["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert svc["clusterIP"] == "None" and svc["selector"].items() <= pod["metadata"]["labels"].items()
        assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["ports"]} == {n: (v, n) for n, v in ports.items()}
        assert ports["http"] == int(flag(c["args"], "--port"))
        if role == "prefill":
            assert ports["bootstrap"] == int(flag(c["args"], "--bootstrap-port"))
        assert (c["startupProbe"]["httpGet"], c["livenessProbe"]["httpGet"], c["readinessProbe"]["httpGet"]) == (
            {"path": "/health", "port": "http", "scheme": scheme},
            {"path": "/health", "port": "http", "scheme": scheme},
            {"path": "/health_generate", "port": "http", "scheme": scheme},
        )
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600  # a large model loads
    router = component(docs, "Deployment", "router")["spec"]["template"]
    rc = router["spec"]["containers"][0]
    assert rc["ports"] == [{"name": "http", "containerPort": int(flag(rc["args"], "--port"))}]
    assert (rc["livenessProbe"]["httpGet"], rc["readinessProbe"]["httpGet"]) == (
        {"path": "/health", "port": "http", "scheme": scheme},
        {"path": "/readiness", "port": "http", "scheme": scheme},
    )
    svc = component(docs, "Service", "router")["spec"]
    assert svc["ports"][0]["targetPort"] == "http" and svc["selector"].items() <= router["metadata"]["labels"].items()


@pytest.mark.parametrize("values_file", EXAMPLES, ids=lambda p: p.name)
def test_a_stopping_pod_has_time_to_drain(values_file):
    """The router sleeps while its address leaves the Service, then drains; an engine pod drains at once (its
    preStop sends the server SIGTERM and waits for its exit: a decode's streams move to other decodes), and an
    engine Deployment rolls a new pod in before an old one goes."""
    docs = render(example(values_file.name))
    for name in ("router", "prefill", "decode"):
        dep = component(docs, "Deployment", name)["spec"]
        spec = dep["template"]["spec"]
        c = spec["containers"][0]
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        drain = float(flag(c["args"], "--drain-timeout-s"))
        if name == "router":
            assert command[0] == "sleep" and spec["terminationGracePeriodSeconds"] >= int(command[1]) + drain + 10
            assert int(flag(c["args"], "--migration-limit")) >= 1
        else:
            assert command[:2] == ["sh", "-c"] and command[2].startswith("kill -TERM 1;")
            assert spec["terminationGracePeriodSeconds"] >= drain + 10
            assert dep["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        pdb = component(docs, "PodDisruptionBudget", name)["spec"]
        assert pdb["maxUnavailable"] == 1 and pdb["selector"]["matchLabels"].items() <= spec_labels(docs, name)


def spec_labels(docs, name):
    return component(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"].items()


def test_cpu_demo_runs_the_builtin_model_without_gpus_and_signs_with_the_chart_secret():
    docs = render(example("cpu-demo.yaml"))
    for role in ("prefill", "decode"):
        c = container(docs, role)
        assert flag(c["args"], "--model") == "builtin" and flag(c["args"], "--device") == "cpu"
        assert flag(c["args"], "--transfer-protocol") == "tcp" and "--transfer-device" not in c["args"]
        assert "nvidia.com/gpu" not in str(c["resources"]) and "securityContext" not in c
        env = env_of(c)
        ref = env["TANDEM_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
        assert len(secret_value(docs, ref["name"], ref["key"])) == 48
        assert env["TANDEM_ADVERTISE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "TANDEM_API_KEY" not in env_of(container(docs, "router"))
    assert (
        objects(docs, "HorizontalPodAutoscaler") == [] and "--bootstrap-url" not in container(docs, "prefill")["args"]
    )


def test_gpu_rdma_asks_for_the_gpu_the_rdma_device_and_ipc_lock():
    docs = render(example("gpu-1p1d-rdma.yaml"))
    for role in ("prefill", "decode"):
        pod = component(docs, "Deployment", role)["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 1, "rdma/ib": 1, "memory": "96Gi"}
        assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert (
            flag(c["args"], "--transfer-protocol") == "rdma" and flag(c["args"], "--transfer-device") == "mlx5_0,mlx5_1"
        )
        assert flag(c["args"], "--model") == "/models/Meta-Llama-3.1-8B-Instruct"
        models = next(v for v in pod["volumes"] if v["name"] == "models")
        assert models["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert "hostNetwork" not in pod
    assert "rdma/ib" not in str(container(docs, "router").get("resources", {}))


def test_deepseek_example_runs_tp_ranks_per_role_with_an_fp8_kv_cache():
    docs = render(example("cpu-deepseek-tp.yaml"))
    layouts = {}
    for role in ("prefill", "decode"):
        c = container(docs, role)
        config = parse_serve(c["args"])
        assert (config.tp_size, config.kv_cache_dtype, config.device) == (4, "fp8_e4m3", "cpu")
        assert "nvidia.com/gpu" not in str(c["resources"])
        layouts[role] = (config.enable_dp_attention, config.dp_size, config.ep_size)
    assert layouts == {"prefill": (False, 1, 1), "decode": (True, 4, 4)}  # TP-MoE prefill, DP+EP decode
    gpu = example("gpu-1p1d-rdma.yaml")
    gpu["prefill"]["tpSize"] = 2  # a pod asks for one GPU per rank
    docs = render(gpu)
    prefill, decode = container(docs, "prefill"), container(docs, "decode")
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 2 and flag(prefill["args"], "--tp-size") == "2"
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 1 and "--tp-size" not in decode["args"]


def test_hf_model_is_downloaded_by_an_init_container_with_the_token_secret():
    values = example("gpu-2p4d-hf.yaml")
    docs = render(values)
    assert [component(docs, "Deployment", r)["spec"]["replicas"] for r in ("prefill", "decode")] == [2, 4]
    for role in ("prefill", "decode"):
        pod = component(docs, "Deployment", role)["spec"]["template"]["spec"]
        init, c = pod["initContainers"][0], pod["containers"][0]
        local_dir = flag(init["args"], "--local-dir")
        assert init["command"] == ["hf", "download"] and init["args"][0] == "Qwen/Qwen2.5-7B-Instruct"
        assert flag(c["args"], "--model") == local_dir == "/models/hf/Qwen/Qwen2.5-7B-Instruct/main"
        assert flag(c["args"], "--served-model-name") == "Qwen/Qwen2.5-7B-Instruct"
        assert env_of(init)["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
        assert next(v for v in pod["volumes"] if v["name"] == "models")["persistentVolumeClaim"] == {
            "claimName": "hf-models"
        }
        assert env_of(c)["UCX_TLS"]["value"] == "tcp,sm,self,cuda_copy,cuda_ipc" and "UCX_NET_DEVICES" not in env_of(c)
    router = container(docs, "router")
    assert env_of(router)["TANDEM_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "tandem-api-key", "key": "api-key"}
    }
    assert component(docs, "Service", "router")["spec"]["type"] == "LoadBalancer"
    assert objects(docs, "HorizontalPodAutoscaler") == []


def test_autoscaling_gives_each_role_an_hpa_on_a_server_metric_and_leaves_replicas_to_it():
    docs = render(example("gpu-2p4d-hf-autoscale.yaml"))
    for role, metric, bounds in (
        ("prefill", "tandem_num_queue_reqs", (2, 4)),
        ("decode", "tandem_num_running_reqs", (4, 12)),
    ):
        hpa = component(docs, "HorizontalPodAutoscaler", role)["spec"]
        assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"demo-tandem-{role}"}
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == bounds
        assert hpa["metrics"][0]["pods"]["metric"]["name"] == metric
        assert "replicas" not in component(docs, "Deployment", role)["spec"]
    monitor = objects(docs, "ServiceMonitor")[0]
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    for name in ("router", "prefill", "decode"):  # the monitor selects every Service with a port "http"
        svc = component(docs, "Service", name)
        assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


def test_standalone_bootstrap_and_host_network():
    values = example("cpu-demo.yaml") | {
        "bootstrap": {"standalone": {"enabled": True}},
        "transfer": {"backend": "nixl", "protocol": "tcp", "hostNetwork": True},
    }
    docs = render(values)
    registry = container(docs, "bootstrap")
    assert registry["args"] == ["bootstrap", "--host", "0.0.0.0", "--port", "8998"]
    assert (
        "TANDEM_CLUSTER_SECRET" in env_of(registry)
        and component(docs, "Service", "bootstrap")["spec"]["ports"][0]["port"] == 8998
    )
    assert flag(container(docs, "prefill")["args"], "--bootstrap-url") == f"http://{service_host('bootstrap')}:8998"
    router = parse_router(container(docs, "router")["args"])
    assert (router.prefill_bootstrap_host, router.prefill_bootstrap_port) == (service_host("bootstrap"), 8998)
    for role in ("prefill", "decode"):
        pod = component(docs, "Deployment", role)["spec"]["template"]["spec"]
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert env_of(pod["containers"][0])["UCX_TLS"]["value"] == "tcp,sm,self"


def test_a_pod_monitor_and_a_host_path_model():
    docs = render(
        {
            "device": "cpu",
            "model": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}, "path": "m.gguf"},
            "metrics": {"podMonitor": {"enabled": True}},
        }
    )
    pod = component(docs, "Deployment", "decode")["spec"]["template"]["spec"]
    assert flag(pod["containers"][0]["args"], "--model") == "/models/m.gguf"
    assert next(v for v in pod["volumes"] if v["name"] == "models")["hostPath"] == {
        "path": "/mnt/models",
        "type": "Directory",
    }
    assert (
        env_of(pod["containers"][0])["TANDEM_CACHE_DIR"]["value"] == "/var/cache/tandem"
    )  # the GGUF is converted there
    monitor = objects(docs, "PodMonitor")[0]["spec"]
    assert monitor["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]


@pytest.mark.parametrize("claim", ["", "kernels"])
def test_gpu_pods_keep_compiled_kernels_in_a_mounted_cache(claim):
    values = example("gpu-1p1d-rdma.yaml")
    values.setdefault("engine", {})["kernelCache"] = {"claimName": claim, "sizeLimit": "5Gi"}
    docs = render(values)
    for role in ("prefill", "decode"):
        pod = component(docs, "Deployment", role)["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert env_of(c)["TANDEM_KERNEL_CACHE_DIR"]["value"] == "/var/cache/tandem-kernels"
        assert {"name": "kernel-cache", "mountPath": "/var/cache/tandem-kernels"} in c["volumeMounts"]
        volume = next(v for v in pod["volumes"] if v["name"] == "kernel-cache")
        assert volume == (
            {"name": "kernel-cache", "persistentVolumeClaim": {"claimName": "kernels"}}
            if claim
            else {"name": "kernel-cache", "emptyDir": {"sizeLimit": "5Gi"}}
        )
    cpu = render(example("cpu-demo.yaml"))
    assert "kernel-cache" not in str(component(cpu, "Deployment", "prefill")["spec"]["template"]["spec"])
