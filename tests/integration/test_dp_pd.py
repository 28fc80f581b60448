"""PD with DP attention and expert parallelism on either side (docs/dp-attention.md): each mix of layouts
gives transformers' greedy tokens through the router, each request's KV landing in its decode DP rank's
pool, every DP rank of every server idle after; a prefill registers its DP ranks with the bootstrap; a
prefill whose attention split cannot hold the model's KV heads is refused, naming both layouts.

    DeepSeek-V3 (MLA)     prefill TP 2 (TP-MoE)  ->  decode DP 2 + EP 2
    Qwen3-MoE (2 KV heads) prefill DP 2 + EP 2    ->  decode TP 2 + EP 2 (each decode rank one KV head)
    DeepSeek-V2 (MLA)     prefill DP 2 + EP 2    ->  decode DP 3 + EP 3 (+1 redundant copy)

The three clusters start at once."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from bootstrap.client import lookup_prefill, register_prefill
from tests.integration.cluster import spawn_cluster
from tests.integration.moe_models import save_family
from tests.integration.test_tensor_parallel import CHUNKED, assert_same_tokens, generate_all
from tests.integration.tiny_model import hf_greedy, random_prompts

NEW_TOKENS = 12


def dp_ep(n: int, *extra: str) -> tuple[str, ...]:
    return ("--tp-size", str(n), "--ep-size", str(n), "--enable-dp-attention", "--dp-size", str(n), *extra)


MIXES = {  # family -> (prefill flags, decode flags)
    "deepseek_v3": (("--tp-size", "2"), dp_ep(2)),
    "qwen3_moe": (dp_ep(2), ("--tp-size", "2", "--ep-size", "2")),
    "deepseek_v2": (dp_ep(2), dp_ep(3, "--ep-num-redundant-experts", "1")),
}


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp-pd")
    started = {}
    try:
        for family, (prefill, decode) in MIXES.items():
            save_family(root / family, family)
            flags = ("--model", str(root / family), *CHUNKED, "--page-size", "4")
            started[family] = spawn_cluster("mooncake", flags=flags, prefill_flags=prefill, decode_flags=decode)
        for c in started.values():
            c.wait_ready(300)
        yield root, started
    finally:
        for c in started.values():
            c.stop()


def dp_ranks_idle(node) -> None:
    """The server's pools hold no request's page, on every DP rank it has."""
    node.wait_idle()
    dp = node.info()["dp"]
    for r in dp["ranks"] if dp else []:
        assert r["kv_pages"]["in_use"] == 0 and r["kv_pages"]["locked"] == 0, (node.name, r)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(MIXES))
def test_each_mix_equals_transformers(clusters, family):
    root, started = clusters
    c, prompts = started[family], random_prompts(6, 20, 150, seed=4)
    hf = AutoModelForCausalLM.from_pretrained(root / family, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    got = generate_all(c.url, prompts, NEW_TOKENS)
    assert_same_tokens(expected, got, f"{family} {' '.join(MIXES[family][0])} -> {' '.join(MIXES[family][1])}")
    decode_dp = c.decodes[0].info()["dp"]
    if decode_dp is not None:  # the decode's DP rank of each request: where its KV went
        ranks = [out["meta_info"]["dp_rank"] for out in got]
        assert all(0 <= r < decode_dp["size"] for r in ranks), ranks
        served = [r["requests_served"] for r in decode_dp["ranks"]]
        assert sum(served) == len(prompts) and served == [ranks.count(d) for d in range(decode_dp["size"])]
    prefill_dp = c.prefills[0].info()["dp"]
    if prefill_dp is not None:
        assert [r["requests_served"] for r in prefill_dp["ranks"]] == [3, 3]  # round_robin
    for node in c.nodes:
        dp_ranks_idle(node)


def test_a_prefill_registers_each_dp_rank(clusters):
    c = clusters[1]["qwen3_moe"]
    url = f"http://127.0.0.1:{c.prefill_bootstrap_ports[0]}"
    instance = httpx.get(c.prefills[0].url + "/health").headers["X-Tandem-Instance-Id"]
    entry = lookup_prefill(url, instance)
    assert (entry["dp_size"], entry["dp_ranks"], entry["experts"], entry["tp_size"]) == (2, [0, 1], "ep 2", 2)
    one = httpx.get(url + "/route", params={"engine_rank": 1, "target_dp_group": 1}).json()
    assert (one["instance_id"], one["dp_rank"], one["rank_port"]) == (instance, 1, entry["rank_port"])


def test_a_prefill_whose_attention_cannot_hold_the_kv_heads_is_refused_naming_both(clusters):
    c = clusters[1]["qwen3_moe"]
    url = f"http://127.0.0.1:{c.prefill_bootstrap_ports[0]}"
    real = lookup_prefill(url, httpx.get(c.prefills[0].url + "/health").headers["X-Tandem-Instance-Id"])
    forged = {k: v for k, v in real.items() if k != "dp_ranks"} | {"instance_id": "prefill-split3", "tp_size": 3}
    forged |= {"dp_size": 1, "dp_rank": 0, "tp_rank": 0}  # 3 attention ranks cannot split 2 KV heads
    register_prefill(url, forged)
    body = {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 2}, "bootstrap_host": "127.0.0.1"}
    body |= {
        "bootstrap_port": c.prefill_bootstrap_ports[0],
        "bootstrap_room": 77,
        "prefill_instance_id": "prefill-split3",
    }
    r = httpx.post(c.decodes[0].url + "/generate", json=body, timeout=60)
    message = r.json()["error"]["message"]
    assert r.status_code == 502 and "prefill attention (tp_size 3, dp_size 1)" in message, r.text
    assert "decode layout:" in message and "prefill layout:" in message and "dp_size=1" in message
    dp_ranks_idle(c.decodes[0])
