"""A real router process that finds its workers by DNS (`localhost`, as a headless Service name stands
for its pods), with no --prefill/--decode."""

from __future__ import annotations

import httpx

from tests.conftest import ServerProcess, free_port, start_server
from tests.integration.cluster import generate


def test_router_discovers_prefill_and_decode_by_name_and_serves_through_them(builtin_model_dir):
    boot = free_port()
    prefill = start_server("--disaggregation-mode", "prefill", "--bootstrap-port", str(boot), name="prefill-disc")
    decode = start_server("--disaggregation-mode", "decode", name="decode-disc")
    router = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        for node in (prefill, decode):  # the readiness probe of the Helm chart's pods
            assert httpx.get(node.url + "/health_generate", timeout=30).status_code == 200
        port = free_port()
        router = ServerProcess(
            [
                "router",
                "--prefill-discovery",
                f"localhost:{prefill.port}",
                "--decode-discovery",
                f"localhost:{decode.port}",
                "--prefill-bootstrap-port",
                str(boot),
                "--discovery-interval-s",
                "0.5",
                "--port",
                str(port),
            ],
            port,
            name="router-disc",
            health="/readiness",
        ).wait_ready(60)
        workers = {w["url"]: w for w in httpx.get(router.url + "/workers", timeout=10).json()["workers"]}
        assert sorted(workers) == sorted(
            [prefill.url, decode.url]
        )  # 127.0.0.1 only: localhost's ::1 is no second worker
        assert workers[prefill.url]["role"] == "prefill" and workers[prefill.url]["bootstrap_port"] == boot
        assert workers[decode.url]["role"] == "decode" and all(w["healthy"] for w in workers.values())
        out = generate(router.url, [1, 2, 3, 4, 5], max_new=8)
        assert out["meta_info"]["completion_tokens"] == 8 and len(out["output_ids"]) == 8
    finally:
        for p in (router, decode, prefill):
            if p is not None:
                p.stop()


def test_decodes_are_sent_to_the_standalone_registry_the_prefills_registered_with(builtin_model_dir, monkeypatch):
    """The registry listens on 127.0.0.2, the prefill on 127.0.0.1: a router that sent the prefill's own
    host would point the decode at nothing. The cluster secret reaches every process from the environment."""
    monkeypatch.setenv("TANDEM_CLUSTER_SECRET", "discovery-test-secret")
    boot = free_port()
    registry = ServerProcess(["bootstrap", "--host", "127.0.0.2", "--port", str(boot)], boot, name="bootstrap-disc")
    registry.url = f"http://127.0.0.2:{boot}"
    prefill = start_server("--disaggregation-mode", "prefill", "--bootstrap-url", registry.url, name="prefill-boot")
    decode = start_server("--disaggregation-mode", "decode", name="decode-boot")
    router = None
    try:
        for p in (registry, prefill, decode):
            p.wait_ready()
        port = free_port()
        router = ServerProcess(
            [
                "router",
                "--prefill-discovery",
                f"localhost:{prefill.port}",
                "--decode-discovery",
                f"localhost:{decode.port}",
                "--prefill-bootstrap-host",
                "127.0.0.2",
                "--prefill-bootstrap-port",
                str(boot),
                "--port",
                str(port),
            ],
            port,
            name="router-boot",
            health="/readiness",
        ).wait_ready(60)
        assert generate(router.url, [5, 6, 7], max_new=4)["meta_info"]["completion_tokens"] == 4
        forged = httpx.put(registry.url + "/route", json={"role": "Prefill"}, timeout=10)
        assert forged.status_code == 401, forged.text  # the registry got the secret from TANDEM_CLUSTER_SECRET
    finally:
        for p in (router, decode, prefill, registry):
            if p is not None:
                p.stop()
