"""Tensor parallelism for the MoE and MLA families: tiny DeepSeek-V3, Qwen3-MoE and Mixtral served at
`--tp-size 2` (experts' intermediate features and query heads split, the router gate and the MLA latent
whole on every rank) give transformers' greedy tokens in float32, prompts longer than the chunked-prefill
size, one server per family. A divergence is accepted only at a near-tie (as test_tensor_parallel)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import start_server
from tests.integration.moe_models import save_family
from tests.integration.test_tensor_parallel import CHUNKED, assert_same_tokens, generate_all
from tests.integration.tiny_model import hf_greedy, random_prompts

NEW_TOKENS = 12
# family -> each rank's (query heads, KV heads): MLA keeps one latent "head" whole on every rank
RANK_HEADS = {"deepseek_v3": (2, 1), "qwen3_moe": (2, 1), "mixtral": (2, 1)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", list(RANK_HEADS))
def test_family_at_tp2_equals_transformers(tmp_path, family):
    model_dir = save_family(tmp_path / family, family)
    prompts = random_prompts(3, 20, 150, seed=3)
    assert max(map(len, prompts)) > 64  # prefilled in chunks
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    server = start_server("--model", str(model_dir), *CHUNKED, "--page-size", "4", "--tp-size", "2", name=family)
    try:
        server.wait_ready(300)
        assert_same_tokens(expected, generate_all(server.url, prompts, NEW_TOKENS), f"{family} TP 2")
        ranks = server.info()["tp"]["ranks"]
        assert [(r["q_heads"], r["kv_heads"]) for r in ranks] == [RANK_HEADS[family]] * 2
        server.wait_idle()
    finally:
        server.stop()
