"""EAGLE's draft: a head of one Llama decoder layer over the target's hidden states, read from its own
directory (`--speculative-draft-model-path`; SGLang's llama_eagle.py, architecture LlamaForCausalLMEagle).

Its checkpoint names `fc.weight` (and `fc.bias` when it has one), `layers.0.*` and maybe `embed_tokens.weight`
and `lm_head.weight`, with or without a `model.` prefix. For the target's hidden state h_i at position i
(after the final norm, as NEXTN reads it) and the token t_{i+1} that followed it:

    x = fc(cat(embed(t_{i+1}), h_i))  ->  decoder layer at position i, without its input norm (EAGLE skips
                                          layer 0's), and no final norm

and the LM head over that guesses t_{i+2}; the output is the next step's h. The embedding and LM head are the
head's own where its checkpoint has them, else the target's. The decoder layer's KV is one more layer of the
target's pages (layer id num_hidden_layers of the target), so its attention must have the target's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch
from common.model.draft_head import DraftHead
from common.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from common.model.loader import materialize, resolve_model_dir
from common.model.registry import attention_spec
from common.model.rotary import RotaryEmbedding, head_dim_of
from common.model.weights import fill_from_shard, read_header
from common.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from common.wire.user_error import UserError

FLAG = "--speculative-draft-model-path"
H = TypeVar("H", bound=DraftHead)


class EagleHead(DraftHead):
    method = "EAGLE"

    def __init__(self, config: PretrainedConfig, layer_id: int, present: set[str]):
        """`present`: the parameter names the checkpoint holds (fc.bias, embed_tokens and lm_head are optional)."""
        h, vocab = config.hidden_size, config.vocab_size
        super().__init__(h)
        self.fc = nn.Linear(2 * h, h, bias="fc.bias" in present)
        self.decoder = DecoderLayer(config, layer_id)
        self.decoder.input_layernorm = nn.Identity()
        self.rotary_emb = RotaryEmbedding(config)
        self.embed_tokens = VocabParallelEmbedding(vocab, h) if "embed_tokens.weight" in present else None
        self.lm_head = ParallelLMHead(vocab, h) if "lm_head.weight" in present else None

    def forward(
        self, target: LlamaForCausalLM, batch: ForwardBatch, attn: AttentionBackend, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The head's output of every row: token batch.input_ids[j] after the target's `hidden[j]`."""
        embed = self.embed_tokens if self.embed_tokens is not None else target.model.embed_tokens
        x = embed(batch.input_ids)
        x = self.fc(torch.cat((x, hidden.to(x.dtype)), dim=-1))
        return self.decoder(x, self.rotary_emb(batch, x.dtype), attn, batch)

    def draft_tokens(self, target: LlamaForCausalLM, out: torch.Tensor) -> torch.Tensor:
        return (self.lm_head if self.lm_head is not None else target.lm_head)(out).float().argmax(dim=-1)


def head_param_name(name: str) -> str | None:
    """The head's parameter a checkpoint tensor fills (the name with or without `model.`); None: one the head
    does not use (layer 0's input norm, which EAGLE skips)."""
    name = name.removeprefix("model.")
    if not name.startswith("layers.0."):
        return name  # fc.*, embed_tokens.weight, lm_head.weight (anything else is refused by the loader)
    rest = name.removeprefix("layers.0.")
    return None if rest.startswith("input_layernorm.") else "decoder." + rest


def eagle_config(path: str, hf: PretrainedConfig, method: str = "EAGLE") -> tuple[Path, PretrainedConfig]:
    """The head's directory and config (an EAGLE or EAGLE3 head), refused before anything loads when its
    shape is not the target's."""
    head_dir = resolve_model_dir(path, FLAG)
    try:
        head_hf = AutoConfig.from_pretrained(head_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"{FLAG} {path}: no {method} head's config.json can be read ({e})") from None
    if head_hf.num_hidden_layers != 1:
        raise UserError(f"{FLAG} {path}: an {method} head of {head_hf.num_hidden_layers} layers; one is implemented")
    t = attention_spec(hf)
    mine = (t.kind, hf.hidden_size, t.q_heads, t.kv_heads, t.head_dim, hf.vocab_size)
    heads = (head_hf.num_attention_heads, head_hf.num_key_value_heads, head_dim_of(head_hf))
    theirs = ("mha", head_hf.hidden_size, *heads, head_hf.vocab_size)
    if mine != theirs:
        raise UserError(
            f"{FLAG} {path}: the {method} head's (attention, hidden size, query heads, KV heads, head dim, vocabulary) "
            f"is {theirs}, the target's {mine}; it reads the target's hidden states and keeps its KV as one more "
            "layer of the target's pages, so they must match: give the head trained for this target"
        )
    return head_dir, head_hf


def load_eagle_head(
    found: tuple[Path, PretrainedConfig], target: LlamaForCausalLM, dtype: torch.dtype, device: str
) -> EagleHead:
    """The head, its weights read from its directory's shards, its KV the pool's layer after the target's."""
    return load_head(found, target, EagleHead, head_param_name, dtype, device)


def load_head(
    found: tuple[Path, PretrainedConfig],
    target: LlamaForCausalLM,
    build: Callable[[PretrainedConfig, int, set[str]], H],
    param_name: Callable[[str], str | None],
    dtype: torch.dtype,
    device: str,
) -> H:
    """An EAGLE or EAGLE3 head: `build(config, layer_id, present)` makes it on the meta device (its layer the
    pool's after the target's, `present` the parameters the checkpoint holds), `param_name` maps each
    checkpoint tensor to its parameter, and its weights are read from its directory's shards."""
    head_dir, head_hf = found
    shards = head_shards(head_dir)
    mapped = {n: param_name(n) for header in shards.values() for n in header}
    with torch.device("meta"):
        head = build(head_hf, target.config.num_hidden_layers, {p for p in mapped.values() if p})
    load_head_weights(head, head_dir, shards, mapped, dtype, device)
    return head


def head_shards(head_dir: Path) -> dict[Path, dict[str, dict]]:
    """Each of the head's shards and its tensors' entries (read_header's)."""
    shards = {shard: read_header(shard)[0] for shard in sorted(head_dir.glob("*.safetensors"))}
    if not shards:
        raise UserError(f"{FLAG} {head_dir}: no *.safetensors weights; give the directory that holds them")
    return shards


def load_head_weights(
    head: DraftHead, head_dir: Path, shards: dict[Path, dict], mapped: dict[str, str | None], dtype, device: str
) -> DraftHead:
    """`head` (built on the meta device) given storage and filled: `mapped` gives each checkpoint tensor's
    parameter (None: one the head does not use); a tensor it has no parameter for, or a parameter no tensor
    fills, or another shape, is refused naming them."""
    materialize(head, dtype, device)
    for module in head.modules():
        if isinstance(module, (Attention, MLP)):
            module.fuse(filled=False)
    params = dict(head.named_parameters())
    unknown = sorted(n for n, p in mapped.items() if p is not None and p not in params)
    missing = sorted(set(params) - set(mapped.values()))
    what = f"{FLAG} {head_dir}: not an {head.method} head"
    if unknown or missing:
        raise UserError(f"{what}: tensors {unknown[:4]} unknown, {missing[:4]} missing")
    for shard, header in shards.items():
        names = [n for n in header if mapped[n] is not None]
        wrong = [n for n in names if list(header[n]["shape"]) != list(params[mapped[n]].shape)]
        if wrong:
            raise UserError(f"{FLAG} {shard}: the {head.method} head's {wrong[:4]} have other shapes than its config's")
        fill_from_shard(shard, names, {n: params[mapped[n]] for n in names})
    head.model_dir = head_dir
    return head.eval()
