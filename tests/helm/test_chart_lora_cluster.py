"""The chart's LoRA values run: a CPU release with a model and two adapters on node directories (hostPath), its
rendered prefill, decode and router containers run as local processes (tests/helm/pods.py: the volumes' mount
paths swapped for the local directories holding what the volumes would). Through the router each adapter's
greedy tokens equal `peft`'s on transformers, and the base model's its own: the decode holds every adapter its
prefill computes the KV under, as the chart gives both the same."""

from __future__ import annotations

import httpx

from tests.conftest import free_port
from tests.helm.chart import render
from tests.helm.pods import process
from tests.integration.test_lora import ADAPTERS, NEW_TOKENS, peft_greedy, save_adapter
from tests.integration.tiny_model import random_prompts, save_tiny_llama

VALUES = {
    "device": "cpu",
    "model": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}, "path": "tiny"},
    "engine": {"extraArgs": ["--page-size", "4", "--max-total-tokens", "4096"]},
    "lora": {
        "enabled": True,
        "source": "hostPath",
        "hostPath": {"path": "/mnt/adapters"},
        "adapters": [{"name": "a", "path": "tiny/a"}, {"name": "b", "path": "tiny/b"}],
        "maxLorasPerBatch": 2,
    },
}


def generate(url: str, ids: list[int], adapter: str | None) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    body |= {"lora_path": adapter} if adapter else {}
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_the_rendered_pods_serve_each_adapter_from_the_volume_with_peft_tokens(tmp_path):
    base = save_tiny_llama(tmp_path / "models" / "tiny")
    adapters = {
        n: save_adapter(base, tmp_path / "adapters" / "tiny" / n, *ADAPTERS[n], seed=i) for i, n in enumerate("ab")
    }
    prompts = random_prompts(2, 20, 40, seed=11)
    expected = {n: peft_greedy(base, adapters.get(n), prompts) for n in (None, "a", "b")}
    assert expected["a"] != expected[None] != expected["b"]  # else the test would prove nothing
    mounts = {"/models": tmp_path / "models", "/adapters": tmp_path / "adapters", "/var/cache/tandem": tmp_path}
    docs = render(VALUES)
    p_http, p_boot, d_http, r_http = free_port(), free_port(), free_port(), free_port()
    servers = []
    try:
        flags = {"--port": str(p_http), "--bootstrap-port": str(p_boot)}
        servers.append(process(docs, "prefill", flags, p_http, mounts=mounts))
        servers.append(process(docs, "decode", {"--port": str(d_http)}, d_http, mounts=mounts))
        for s in servers:
            s.wait_ready()
        flags = {
            "--port": str(r_http),
            "--prefill-bootstrap-port": str(p_boot),
            "--prefill-discovery": f"localhost:{p_http}",
            "--decode-discovery": f"localhost:{d_http}",
        }
        router = process(docs, "router", flags, r_http, health="/readiness").wait_ready(60)
        servers.append(router)
        for name, tokens in expected.items():
            assert [generate(router.url, p, name) for p in prompts] == tokens, f"adapter {name}"
    finally:
        for s in reversed(servers):
            s.stop()
