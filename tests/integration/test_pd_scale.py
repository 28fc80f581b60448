"""PD at scale and with a misconfigured peer: 2 prefill + 2 decode behind one router, and a decode
that must refuse a prefill whose KV layout differs."""

from __future__ import annotations

import concurrent.futures

import httpx

from tests.integration.cluster import generate, start_cluster
from tests.integration.test_pd import FLAGS, expected, mono, prompts  # noqa: F401  (module fixtures)


def test_two_prefill_two_decode_serve_32_concurrent_requests(prompts, expected):
    c = start_cluster("mooncake", n_prefill=2, n_decode=2, flags=FLAGS["mooncake"])
    try:
        jobs = [(i % len(prompts)) for i in range(32)]
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda i: generate(c.url, prompts[i])["output_ids"], jobs))
        assert results == [expected[i] for i in jobs]
        served = [n.info() for n in c.nodes]
        assert all(s["kv_pages"]["total"] > 0 for s in served)
        c.wait_idle()
    finally:
        c.stop()


def test_decode_refuses_a_prefill_with_another_kv_layout(prompts):
    c = start_cluster("mooncake", flags=("--page-size", "16"), decode_flags=("--page-size", "8"))
    try:
        r = httpx.post(
            c.url + "/generate", json={"input_ids": prompts[3], "sampling_params": {"max_new_tokens": 4}}, timeout=120
        )
        assert r.status_code == 502, r.text
        assert "page_size: decode has 8, prefill has 16" in r.json()["error"]["message"]
        c.wait_idle()
    finally:
        c.stop()
