"""The drafter `--speculative-algorithm` asks for (None without it)."""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import ServerConfig
from common.engine.spec.draft_model import DraftModel
from common.engine.spec.drafter import Drafter
from common.engine.spec.head_drafter import HeadDrafter
from common.engine.spec.ngram import NgramDrafter
from common.model.eagle import EagleHead
from common.model.identity import model_identity
from common.ranks.rank_model import RankModel


def make_drafter(built: RankModel, config: ServerConfig, req_to_token: torch.Tensor) -> Drafter | None:
    algo, draft = config.speculative_algorithm, built.draft
    if algo == "NGRAM":
        return NgramDrafter(
            config.speculative_ngram_min_match_window_size, config.speculative_ngram_max_match_window_size
        )
    if algo == "STANDALONE":
        return DraftModel(draft.model, draft.attn, draft.shares_attn, req_to_token, config.device, draft.model_dir.name)
    head = built.draft_head
    if isinstance(head, EagleHead):
        return HeadDrafter(head, built.model, built.attn, req_to_token, config.device, f"EAGLE head {head.model_dir}")
    if head is not None:
        name = f"NEXTN (the checkpoint's MTP layer, layer {built.model.config.num_hidden_layers})"
        return HeadDrafter(head, built.model, built.attn, req_to_token, config.device, name)
    return None  # the config refuses what is not implemented


def speculative_descriptor(config: ServerConfig, built: RankModel, model_dir: Path) -> str:
    """The KV layout's `speculative` field: the algorithm, and the identity of a draft whose KV the pages hold
    (NEXTN: the target's, whose MTP layer it is; EAGLE: its head's; and the hidden state's size the aux
    record carries)."""
    algo, draft, head = config.speculative_algorithm, built.draft, built.draft_head
    hidden = f"layers=1 hidden={built.model.config.hidden_size}xfloat32"
    if isinstance(head, EagleHead):
        return f"EAGLE head={model_identity(head.model_dir)} {hidden}"
    if head is not None:
        return f"NEXTN mtp={model_identity(model_dir)} {hidden}"
    if draft is None:
        return algo or "none"
    return f"{algo} draft={model_identity(draft.model_dir)} layers={len(draft.model.model.layers)}"
