"""Per-request sampling parameters (SGLang's names and defaults), validated once at the edge."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: the detokenizer tries each of its prefixes on every token
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias in [-100, 100]
# Below this the sampler's logits / temperature can overflow float32; treat it as greedy, like vLLM.
GREEDY_TEMPERATURE = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SamplingParams(BaseModel):
    # NaN and infinity are never meaningful here, and they turn logits into NaN on the scheduler thread.
    # Strict: "2" is no integer (a float field still takes an integer).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

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
    # token id -> added to its logit before sampling (greedy too); JSON's string keys become ints. Ids are
    # checked against the vocabulary where it is known (common/http/serving.py).
    logit_bias: dict[int, float] | None = None
    # SGLang's constrained decoding (one at most; common/wire/structured_output.py reads them)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @field_validator("min_new_tokens")
    @classmethod
    def _min_new_tokens(cls, v: int, info: ValidationInfo) -> int:
        top = info.data.get("max_new_tokens")
        if top is not None and v > top:
            raise ValueError(f"must be at most the number of new tokens asked for ({top})")
        return v

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

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v: object) -> object:
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError("logit_bias must be an object mapping token ids to biases")
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(v)}")
        return {_token_id(k): _bias(b) for k, b in v.items()}

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _token_id(key: object) -> int:
    """A logit_bias key: a token id, as JSON's object keys spell it (a string of digits)."""
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
        return int(key)
    raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")


def _bias(value: object) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or abs(value) > LOGIT_BIAS_RANGE:
        raise ValueError(
            f"logit_bias values must be numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {value!r}"
        )
    return float(value)
