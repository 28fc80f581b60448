"""The CPU demo's rendered containers (command, args, env) run as local processes form a working
cluster with the greedy tokens of a monolithic server: the chart and the CLI cannot drift apart.
(tests/helm/pods.py swaps only what a cluster provides; test_chart_image.py runs the same in the image.)"""

from __future__ import annotations

from tests.conftest import free_port
from tests.helm.chart import container, example, objects, render, service_host
from tests.helm.pods import process
from tests.integration.cluster import generate

PROMPT = [504, 3458, 282, 260, 3575, 30, 315, 1186]


def test_cpu_demo_containers_form_a_cluster_with_a_monolithic_servers_tokens(builtin_model_dir, reference_servers):
    docs = render(example("cpu-demo.yaml"))
    assert len(objects(docs, "Secret")) == 1  # the cluster secret every node gets
    p_http, p_boot, d_http, r_http = free_port(), free_port(), free_port(), free_port()
    prefill = decode = router = None
    try:
        prefill = process(docs, "prefill", {"--port": str(p_http), "--bootstrap-port": str(p_boot)}, p_http)
        decode = process(docs, "decode", {"--port": str(d_http)}, d_http)
        mono = reference_servers.get("--model", "builtin")  # a plain `tandem serve` of the containers' model
        expected = generate(mono.url, PROMPT, 16)["output_ids"]
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
        for p in (router, decode, prefill):
            if p is not None:
                p.stop()
