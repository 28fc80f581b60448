"""The drafter `--speculative-algorithm` asks for (None without it)."""

from __future__ import annotations

import torch

from common.config import ServerConfig
from common.engine.spec.draft_model import DraftModel
from common.engine.spec.drafter import Drafter
from common.engine.spec.head_drafter import HeadDrafter
from common.engine.spec.ngram import NgramDrafter
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
    if built.draft_head is not None:  # NEXTN, EAGLE, EAGLE3
        return HeadDrafter(built.draft_head, built.model, built.attn, req_to_token, config.device)
    return None  # the config refuses what is not implemented


def speculative_descriptor(config: ServerConfig, built: RankModel) -> str:
    """The KV layout's `speculative` field: the algorithm, and the identity of a draft whose KV the pages hold
    (a draft head names itself: common/model/draft_head.py)."""
    algo, draft = config.speculative_algorithm, built.draft
    if built.draft_head is not None:
        return built.draft_head.speculative_descriptor()
    if draft is None:
        return algo or "none"
    return f"{algo} draft={model_identity(draft.model_dir)} layers={len(draft.model.model.layers)}"
