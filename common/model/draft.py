"""STANDALONE's draft model as every engine loads it: checked against the target before anything loads (the
same vocabulary, the same KV shape per layer: its KV is stored as more layers of the target's pages), loaded
whole (it runs on one rank), its attention layers moved past the target's in the pool."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from common.attention.base import AttentionBackend
from common.core.attention_spec import AttentionSpec
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_hf_config, load_model, resolve_model_dir
from common.model.registry import attention_spec
from common.wire.user_error import UserError


@dataclass
class DraftWeights:
    model: LlamaForCausalLM
    model_dir: Path
    attn: AttentionBackend | None = None  # over the target's pool: the target's own when the heads match
    shares_attn: bool = False

    def heads(self) -> tuple[int, int, float]:
        d = attention_spec(self.model.config)
        return d.q_heads, d.head_dim, d.scaling


def draft_config(path: str | None, hf: PretrainedConfig) -> tuple[Path, PretrainedConfig] | None:
    """The draft's directory and config (None without one), refused naming both shapes when they differ."""
    if not path:
        return None
    draft_dir = resolve_model_dir(path, "--speculative-draft-model-path")
    draft_hf = load_hf_config(draft_dir)
    target, draft = attention_spec(hf), attention_spec(draft_hf)
    mine = (target.kind, target.kv_heads, target.head_dim, target.v_head_dim, hf.vocab_size)
    theirs = (draft.kind, draft.kv_heads, draft.head_dim, draft.v_head_dim, draft_hf.vocab_size)
    if mine != theirs:
        raise UserError(
            f"--speculative-draft-model-path {path}: its (attention, KV heads, head dim, V head dim, vocabulary) is "
            f"{theirs}, the target's {mine}; a STANDALONE draft keeps its KV as more layers of the target's pages, "
            "so they must match: give a draft of the same family (e.g. the target's first layers: "
            "python -m common.model.truncate)"
        )
    return draft_dir, draft_hf


def load_draft(
    found: tuple[Path, PretrainedConfig], dtype: torch.dtype, device: str, target_layers: int
) -> DraftWeights:
    """The draft model, every attention layer reading and writing the pool's layer target_layers + its own."""
    draft_dir, draft_hf = found
    model = load_model(draft_dir, draft_hf, dtype, device)
    for module in model.modules():
        if isinstance(getattr(module, "layer_id", None), int):
            module.layer_id += target_layers
    return DraftWeights(model, draft_dir)


def with_draft_layers(spec: AttentionSpec, draft: DraftWeights | None) -> AttentionSpec:
    """The pool's shape: the target's layers, then the draft's."""
    if draft is None:
        return spec
    return dataclasses.replace(spec, num_layers=spec.num_layers + draft.model.config.num_hidden_layers)
