"""Llama 3, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm): tiny random models saved by transformers,
loaded by the engine, greedy tokens equal to transformers' generate."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.wire.sampling_params import SamplingParams
from common.wire.user_error import UserError
from tests.integration.tiny_model import hf_greedy

VOCAB = 512
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
ARCHES = {
    "llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral": ("mistral", {"head_dim": 16}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 16}),
}


def save_tiny(path, model_type: str, extra: dict) -> None:
    config = AutoConfig.for_model(model_type, **(COMMON | extra))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), eos_token=f"t{VOCAB - 1}"
    ).save_pretrained(path)


def engine_tokens(path, prompts: list[list[int]], new: int, page_size: int) -> list[list[int]]:
    engine = Engine(
        ServerConfig(model=str(path), page_size=page_size, chunked_prefill_size=16 * page_size, max_total_tokens=4096)
    )
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.scheduler.add_request(r)
    while engine.scheduler.step():
        pass
    counts = engine.memory.check_integrity()
    assert counts.owned == counts.locked == 0
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("arch", list(ARCHES))
def test_greedy_tokens_equal_transformers(tmp_path, arch):
    model_type, extra = ARCHES[arch]
    save_tiny(tmp_path, model_type, extra)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (3, 40, 300)]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    want = hf_greedy(hf, prompts, 12)
    assert engine_tokens(tmp_path, prompts, 12, page_size=4) == want


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(UserError, match="GPT2LMHeadModel is not supported"):
        Engine(ServerConfig(model=str(tmp_path)))
