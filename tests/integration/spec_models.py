"""Models for the speculative decoding tests: a tiny Llama whose last layers barely change the residual
stream, so its first layers plus its head (a STANDALONE draft cut by common/model/truncate.py) agree with it
often but not always; and a Llama of 8 tokens for the statistical test of sampled acceptance."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from common.model.truncate import truncate_model


def save_llama(path: Path, vocab: int, layers: int, quiet_from: int | None = None, tail_scale: float = 0.1) -> Path:
    """A random Llama; layers from `quiet_from` on have their output projections scaled by `tail_scale`."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[quiet_from if quiet_from is not None else layers :]:
            layer.self_attn.o_proj.weight.mul_(tail_scale)
            layer.mlp.down_proj.weight.mul_(tail_scale)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{vocab - 1}").save_pretrained(path)
    return path


def save_target_and_draft(root: Path) -> tuple[Path, Path]:
    """A 4-layer target whose last two layers are quiet, and its first two layers as the draft."""
    target = save_llama(root / "target", vocab=512, layers=4, quiet_from=2)
    return target, truncate_model(str(target), 2, root / "draft")
