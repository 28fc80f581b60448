"""The fast tier's PD round trip on each transfer backend (test_pd.py is the whole check): router ->
prefill -> Mooncake | NIXL -> decode on the tiny random Llama, greedy tokens equal to transformers'
generate, and every pool idle afterwards."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.integration.cluster import generate, start_cluster
from tests.integration.tiny_model import random_prompts

FLAGS = {  # one backend with chunked prefill over pages of 16, the other with single-token pages
    "mooncake": ("--page-size", "16", "--chunked-prefill-size", "64"),
    "nixl": ("--page-size", "1", "--chunked-prefill-size", "0"),
}
MODULES = {"mooncake": "mooncake.engine", "nixl": "nixl._api"}
PROMPTS = random_prompts(3, 5, 150, seed=3)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        tokens = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
        )
        out.append(tokens[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module", params=list(FLAGS))
def cluster(request, tiny_model_dir):
    pytest.importorskip(MODULES[request.param])
    c = start_cluster(request.param, flags=("--model", str(tiny_model_dir), *FLAGS[request.param]))
    yield c
    c.stop()


@pytest.mark.smoke
def test_greedy_tokens_through_the_router_equal_transformers(cluster, expected):
    assert max(len(p) for p in PROMPTS) > 64  # more than one prefill chunk on mooncake
    for ids, want in zip(PROMPTS, expected):
        got = generate(cluster.url, ids, NEW_TOKENS, sampling={"ignore_eos": True})
        assert got["output_ids"] == want, f"prompt of {len(ids)} tokens diverged"
    cluster.wait_idle()
