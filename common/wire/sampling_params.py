"""Per-request sampling parameters (SGLang's names and defaults), validated once at the edge."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: the detokenizer tries each of its prefixes on every token
MAX_STOP_TOKEN_IDS = 256
# Below this the sampler's logits / temperature can overflow float32; treat it as greedy, like vLLM.
GREEDY_TEMPERATURE = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SamplingParams(BaseModel):
    # NaN and infinity are never meaningful here, and they turn logits into NaN on the scheduler thread.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=0, le=1_000_000)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # logits are divided and multiplied by it: a bound keeps them finite in float32 (SGLang allows up to 2)
    repetition_penalty: float = Field(1.0, ge=0.01, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # a 64-bit seed keys the request's own random stream (engine sampler); choices of n > 1 use seed + index
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(1, ge=1, le=16)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: object) -> object:
        if v is None:
            return None
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("stop must be a string or a list of strings")
        if len(v) > MAX_STOP_STRINGS or any(s == "" for s in v):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return v

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
