"""bf16 past 2,000 tokens: greedy tokens equal transformers' (same dtype, same weights) for every RoPE
scaling type, with chunked prefill and two requests decoding in one batch. A bf16 `inv_freq` (the bug
this guards against) moves the angles by radians at these positions and changes the tokens at once."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.model.rotary import RotaryEmbedding
from common.wire.sampling_params import SamplingParams
from tests.integration.test_architectures import VOCAB, save_tiny
from tests.integration.tiny_model import hf_greedy

NEW_TOKENS = 16
LENGTHS = (2100, 2600)
ROPES = {
    "default": {"max_position_embeddings": 4096},
    "llama3": {
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    },
    "linear": {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "yarn": {
        "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    },
    # longrope switches from the short to the long factors past original_max_position_embeddings
    "longrope": {
        "max_position_embeddings": 4096,
        "rope_scaling": {
            "rope_type": "longrope",
            "original_max_position_embeddings": 1024,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
        },
    },
    # dynamic NTK rescales once a sequence outgrows max_position_embeddings: 2,100 and 2,600 both do
    "dynamic": {"max_position_embeddings": 1024, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
}


def hf_tokens(path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    return hf_greedy(model, prompts, NEW_TOKENS)


def engine_tokens(path, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(
        ServerConfig(
            model=str(path),
            dtype="bfloat16",
            page_size=16,
            chunked_prefill_size=256,
            max_total_tokens=8192,
            context_length=4096,
        )
    )
    assert engine.runner.model.model.rotary_emb.inv_freq.dtype == torch.float32
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.scheduler.add_request(r)
    while engine.scheduler.step():
        pass
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("rope", list(ROPES))
def test_bf16_greedy_tokens_past_2000_positions_equal_transformers(tmp_path, rope):
    save_tiny(tmp_path, "llama", ROPES[rope])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in LENGTHS]
    assert engine_tokens(tmp_path, prompts) == hf_tokens(tmp_path, prompts)


def test_inv_freq_stays_float32_through_casts_and_moves(tmp_path):
    save_tiny(tmp_path, "llama", ROPES["llama3"])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        rope = RotaryEmbedding(config)
    exact = rope.inv_freq.clone()
    assert exact.device.type == "cpu" and exact.dtype == torch.float32  # real values, even under a meta build
    moved = rope.to(torch.bfloat16).to_empty(device="cpu").to(torch.float16)
    assert moved.inv_freq.dtype == torch.float32
    assert torch.equal(moved.inv_freq, exact)
