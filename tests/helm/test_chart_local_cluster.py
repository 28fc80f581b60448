"""The CPU demo's rendered containers (command, args, env) run as local processes form a working
cluster with the greedy tokens of a monolithic server: the chart and the CLI cannot drift apart.

Only what a cluster provides is swapped: each container's ports for free local ones, 0.0.0.0 for
127.0.0.1, the Services' DNS names for `localhost`, the pod IP for 127.0.0.1, Secret references for
the rendered Secret's value."""

from __future__ import annotations

from tests.conftest import ServerProcess, free_port, start_server
from tests.helm.chart import container, example, objects, render, secret_value, service_host
from tests.integration.cluster import generate

PROMPT = [504, 3458, 282, 260, 3575, 30, 315, 1186]


def localize(args: list[str], values: dict[str, str]) -> list[str]:
    """`args` with the value after each flag in `values` swapped; every one must be there."""
    out = list(args)
    for name, value in values.items():
        assert out.count(name) == 1, f"{name} is not in {args}"
        out[out.index(name) + 1] = value
    return out


def local_env(c: dict, docs: list[dict]) -> dict[str, str]:
    env = {}
    for e in c.get("env", []):
        source = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = "127.0.0.1"
        else:
            ref = source["secretKeyRef"]
            env[e["name"]] = secret_value(docs, ref["name"], ref["key"])
    return env


def process(docs: list[dict], role: str, flags: dict[str, str], port: int, health: str = "/health") -> ServerProcess:
    c = container(docs, role)
    assert c["command"] == ["tandem"]  # ServerProcess runs `python -m tandem`, the same entry point
    args = localize(c["args"], {"--host": "127.0.0.1", **flags})
    left = [a for a in args if "svc.cluster.local" in a or a in ("0.0.0.0", "30000", "8998", "8000")]
    assert left == [], f"in-cluster values left in {role}'s command: {left}"
    return ServerProcess(args, port, name=f"chart-{role}", health=health, env=local_env(c, docs))


def test_cpu_demo_containers_form_a_cluster_with_a_monolithic_servers_tokens(builtin_model_dir):
    docs = render(example("cpu-demo.yaml"))
    assert len(objects(docs, "Secret")) == 1  # the cluster secret every node gets
    p_http, p_boot, d_http, r_http = free_port(), free_port(), free_port(), free_port()
    mono = start_server(name="chart-mono")  # starts with the chart's prefill and decode
    prefill = decode = router = None
    try:
        prefill = process(docs, "prefill", {"--port": str(p_http), "--bootstrap-port": str(p_boot)}, p_http)
        decode = process(docs, "decode", {"--port": str(d_http)}, d_http)
        expected = generate(mono.wait_ready().url, PROMPT, 16)["output_ids"]
        mono.stop()
        assert "--max-total-tokens" in prefill.args and "--max-total-tokens" in decode.args  # a small KV pool
        prefill.wait_ready()
        decode.wait_ready()
        router = process(
            docs,
            "router",
            {
                "--port": str(r_http),
                "--prefill-bootstrap-port": prefill.arg("--bootstrap-port"),  # where they listen
                "--prefill-discovery": f"localhost:{prefill.port}",
                "--decode-discovery": f"localhost:{decode.port}",
            },
            r_http,
            health="/readiness",
        ).wait_ready(60)
        assert f"{service_host('prefill')}:30000" in container(docs, "router")["args"]  # what was swapped
        out = generate(router.url, PROMPT, 16)
        assert out["output_ids"] == expected and out["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        for p in (router, decode, prefill, mono):
            if p is not None:
                p.stop()
