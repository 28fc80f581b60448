"""DP attention and expert parallelism (docs/dp-attention.md) on a monolithic server: tiny DeepSeek-V3,
DeepSeek-V2 and Qwen3-MoE at `--tp-size 2 --ep-size 2 --enable-dp-attention --dp-size 2` give transformers'
greedy tokens and logprobs (within fp32 noise), every DP rank serving and idle after; requests spread over
the DP ranks within 10% of an equal share (round_robin, minimum_tokens); the DeepSeek-V3 routes every
token to one hot expert and runs EPLB every 4 forwards with 2 redundant copies: the hot expert gets a copy
on the other rank and the output stays equal; a DP rank that dies turns /health into a 503 naming it. The
servers start at once; the dead rank's test comes last (it breaks its server)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import start_server
from tests.integration.moe_models import save_family
from tests.integration.test_tensor_parallel import CHUNKED, assert_same_tokens, generate_all
from tests.integration.tiny_model import hf_greedy, random_prompts

NEW_TOKENS = 12
LOGPROB_TOL = 1e-4
DP_EP = ("--tp-size", "2", "--ep-size", "2", "--enable-dp-attention", "--dp-size", "2")
EPLB = ("--ep-num-redundant-experts", "2", "--enable-eplb", "--eplb-rebalance-num-iterations", "4")
FAMILIES = {  # each server's other flags (all round_robin but Qwen3-MoE)
    "deepseek_v3": EPLB,  # every token's pairs include expert HOT, which starts on rank 0 alone
    "deepseek_v2": (),
    "qwen3_moe": ("--load-balance-method", "minimum_tokens"),
}
PLACEMENT = {"deepseek_v2": [[0, 1, 2, 3], [4, 5, 6, 7]], "qwen3_moe": [[0, 1], [2, 3]]}  # whole experts per rank
HOT = 2


def save_skewed(path) -> None:
    """DeepSeek-V3 whose correction bias sends every token to expert HOT (the weights still come from the
    uncorrected scores, and the other two experts of each token are picked as before): transformers routes
    the same way."""
    save_family(path, "deepseek_v3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias[HOT] += 10.0
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp-ep")
    for family in FAMILIES:
        if family == "deepseek_v3":
            save_skewed(root / family)
        else:
            save_family(root / family, family)
    common = (*CHUNKED, "--page-size", "4")
    started = {f: start_server("--model", str(root / f), *common, *DP_EP, *FAMILIES[f], name=f) for f in FAMILIES}
    try:
        for s in started.values():
            s.wait_ready(300)
        yield root, started
    finally:
        for s in started.values():
            s.stop()


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' logprob of each of `tokens` after `prompt` and the tokens before it."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return rows.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def wait_dp_idle(server) -> list[dict]:
    """Every DP rank's pool holds no request's page."""
    server.wait_idle()
    ranks = server.info()["dp"]["ranks"]
    assert all(r["kv_pages"]["in_use"] == 0 and r["kv_pages"]["locked"] == 0 for r in ranks), ranks
    return ranks


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_at_dp2_ep2_equals_transformers(servers, family):
    root, started = servers
    server, prompts = started[family], random_prompts(4, 20, 150, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(root / family, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    before = [r["requests_served"] for r in server.info()["dp"]["ranks"]]
    got = generate_all(server.url, prompts, NEW_TOKENS)
    assert_same_tokens(expected, got, f"{family} DP 2 EP 2")
    for prompt, want, out in zip(prompts, expected, got):
        if out["output_ids"] == want:
            logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(logprobs, hf_logprobs(hf, prompt, want))) < LOGPROB_TOL
    ranks = wait_dp_idle(server)
    assert sorted(out["meta_info"]["dp_rank"] for out in got) == [0, 0, 1, 1]
    assert [r["requests_served"] - b for r, b in zip(ranks, before)] == [2, 2]
    info = server.info()
    assert [(r["q_heads"], r["kv_heads"]) for r in info["tp"]["ranks"]] == [(4, 1 if "deepseek" in family else 2)] * 2
    for held in info["ep"]["placement"].values():  # DeepSeek-V3's: as EPLB left it, 5 experts per rank
        assert held == PLACEMENT[family] if family in PLACEMENT else sorted({e for h in held for e in h}) == [*range(8)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_64_requests_spread_within_10_percent_of_an_equal_share(servers, family):
    server = servers[1][family]
    before = [r["requests_served"] for r in server.info()["dp"]["ranks"]]
    prompts = random_prompts(64, 24, 24, seed=11)
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: generate_all(server.url, [p], 4)[0], prompts))
    ranks = wait_dp_idle(server)
    served = [r["requests_served"] - b for r, b in zip(ranks, before)]
    method = server.info()["dp"]["load_balance_method"]
    print(f"{family} ({method}): requests per DP rank {served}, forward tokens {[r['forward_tokens'] for r in ranks]}")
    assert sum(served) == 64 and all(abs(n - 32) <= 3.2 for n in served), served
    assert sorted({o["meta_info"]["dp_rank"] for o in outs}) == [0, 1]


def test_data_parallel_rank_picks_the_dp_rank_and_one_out_of_range_is_a_400(servers):
    server = servers[1]["qwen3_moe"]
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    for rank in (1, 1, 0):
        r = httpx.post(server.url + "/generate", json=body | {"data_parallel_rank": rank}, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["dp_rank"] == rank, r.text
    r = httpx.post(server.url + "/generate", json=body | {"data_parallel_rank": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "data_parallel_rank", r.text
    assert "this server has 2 DP rank(s)" in r.json()["error"]["message"]
    wait_dp_idle(server)


@pytest.mark.timeout(600)
def test_eplb_copies_the_hot_expert_to_the_other_rank_and_the_output_stays_equal(servers):
    root, started = servers
    server = started["deepseek_v3"]  # at start rank 0 alone holds expert HOT: [0, 1, 2, 3, 4], [0, 1, 5, 6, 7]
    prompts = random_prompts(4, 20, 150, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(root / "deepseek_v3", dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    for _ in range(2):  # with the experts moving every 4 forwards
        assert_same_tokens(expected, generate_all(server.url, prompts, NEW_TOKENS), "EPLB")
    info = server.info()["ep"]
    print(f"EPLB: {info['eplb']}, placement {info['placement']}")
    assert info["eplb"]["rebalances"] >= 4 and info["eplb"]["experts_moved"] > 0
    for held in info["placement"].values():
        assert HOT in held[0] and HOT in held[1], held  # both ranks compute the hot expert's tokens now
    wait_dp_idle(server)


@pytest.mark.timeout(300)
def test_a_dead_dp_rank_turns_health_503_naming_it(servers):
    server = servers[1]["deepseek_v3"]
    follower = server.info()["tp"]["ranks"][1]["pid"]
    os.kill(follower, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (r := httpx.get(server.url + "/health", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline, "the dead DP rank was not noticed within 30 s"
        time.sleep(0.1)
    assert r.status_code == 503 and "dp rank 1" in r.text, r.text
    out = httpx.post(server.url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code in (500, 503) and "dp rank 1" in out.text, out.text
