"""A tiny random Llama (2 layers, vocab 512) saved by transformers, for tests that need many fast
requests rather than a real model: soak, overload, memory pressure, protocol abuse."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 512


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (no EOS stop), on the model's device."""
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(gen[0, len(p) :].tolist())
    return out


def save_tiny_llama(
    path: Path, context: int = 2048, heads: int = 4, kv_heads: int = 2, head_dim: int | None = None
) -> Path:
    """`head_dim`: None for hidden / heads (16); FlashInfer needs 64, 128 or 256."""
    config = LlamaConfig(
        head_dim=head_dim,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=context,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), eos_token=f"t{VOCAB - 1}"
    )
    tok.save_pretrained(path)
    return path


def random_prompts(n: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB - 1, (k,), generator=g).tolist() for k in lens]
