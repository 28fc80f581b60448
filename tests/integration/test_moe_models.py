"""Mixtral, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3 (MLA): tiny random models saved by transformers,
loaded by the engine, greedy tokens equal to transformers' generate in float32, prompts longer than
the chunked-prefill size."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.integration.moe_models import FAMILIES, save_family
from tests.integration.test_architectures import VOCAB, engine_tokens
from tests.integration.tiny_model import hf_greedy


def hf_tokens(path, prompts: list[list[int]], new: int) -> list[list[int]]:
    return hf_greedy(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), prompts, new)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_transformers(tmp_path, family):
    save_family(tmp_path, family)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (3, 40, 300)]
    want = hf_tokens(tmp_path, prompts, 12)
    assert len({t for w in want for t in w}) > 6  # the model says more than one thing
    assert engine_tokens(tmp_path, prompts, 12, page_size=4) == want  # chunks of 64 tokens
