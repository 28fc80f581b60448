"""The drafter `--speculative-algorithm` asks for (None without it)."""

from __future__ import annotations

import torch

from common.config import ServerConfig
from common.engine.spec.draft_model import DraftModel
from common.engine.spec.drafter import Drafter
from common.engine.spec.ngram import NgramDrafter
from common.model.draft import DraftWeights
from common.model.identity import model_identity


def make_drafter(config: ServerConfig, draft: DraftWeights | None, req_to_token: torch.Tensor) -> Drafter | None:
    algo = config.speculative_algorithm
    if algo == "NGRAM":
        return NgramDrafter(
            config.speculative_ngram_min_match_window_size, config.speculative_ngram_max_match_window_size
        )
    if algo == "STANDALONE":
        return DraftModel(draft.model, draft.attn, draft.shares_attn, req_to_token, config.device, draft.model_dir.name)
    return None  # the config refuses what is not implemented


def speculative_descriptor(config: ServerConfig, draft: DraftWeights | None) -> str:
    """The KV layout's `speculative` field: the algorithm, and the identity of a draft whose KV the pages hold."""
    algo = config.speculative_algorithm
    if draft is None:
        return algo or "none"
    return f"{algo} draft={model_identity(draft.model_dir)} layers={len(draft.model.model.layers)}"
