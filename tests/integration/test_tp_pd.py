"""PD at equal tensor parallelism (CPU): a prefill and a decode of the built-in model at TP 3 over
Mooncake, each rank's KV heads moving from prefill rank r to decode rank r; greedy tokens equal the
monolithic server at TP 1 (near-ties reported, see test_tensor_parallel) and every pool is clean after.
A decode at another TP size is refused at pairing with both layouts named."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import start_server
from tests.integration.cluster import generate, start_cluster, start_router
from tests.integration.test_pd import FLAGS, expected, mono, prompts  # noqa: F401  (module fixtures)
from tests.integration.test_tensor_parallel import assert_same_tokens

TP3 = ("--tp-size", "3")


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster("mooncake", flags=(*FLAGS["mooncake"], *TP3))
    yield c
    c.stop()


@pytest.mark.timeout(900)  # seven processes of the built-in model start first
def test_tp3_prefill_and_decode_equal_monolithic_tp1(cluster, prompts, expected):
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda ids: generate(cluster.url, ids, return_logprob=True, top_logprobs_num=2), prompts))
    assert_same_tokens(expected, got, "PD at TP 3")
    for node in cluster.nodes:
        assert node.info()["tp"]["size"] == 3
    cluster.wait_idle()


@pytest.mark.timeout(600)
def test_decode_at_another_tp_size_is_refused_at_pairing(cluster, prompts):
    decode = start_server("--disagg-mode", "decode", "--transfer-backend", "mooncake", *FLAGS["mooncake"], name="d-tp1")
    try:
        router = start_router([(cluster.prefills[0], cluster.prefill_bootstrap_ports[0])], [decode.wait_ready()])
        body = {"input_ids": prompts[3], "sampling_params": {"max_new_tokens": 4}}
        r = httpx.post(router.url + "/generate", json=body, timeout=120)
        assert r.status_code == 502, r.text
        assert "tp_size: decode has 1, prefill has 3" in r.json()["error"]["message"]
        router.stop()
        decode.wait_idle()
        cluster.wait_idle()
    finally:
        decode.stop()
