"""Bodies of /tokenize and /detokenize, which take vLLM's and SGLang's shapes (they differ only where both are
accepted): a `prompt` (SGLang's may be a list of them) or vLLM's chat `messages` to token ids, and ids back to text.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.wire.api import TEMPLATE_ARGS_SET_BY_SERVER, ChatMessage
from common.wire.batch import MAX_PROMPTS
from common.wire.errors import InvalidRequest


class TokenizeRequest(BaseModel):
    """`add_special_tokens` defaults as in vLLM: true for a prompt, false for messages (the template adds them)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | list[str] | None = Field(None, max_length=MAX_PROMPTS)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=32)
    return_token_strs: bool = False  # vLLM's: the tokens' strings beside their ids

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of prompt or messages", param="prompt")
        taken = sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_ARGS_SET_BY_SERVER)
        if taken:
            raise InvalidRequest(f"chat_template_kwargs: {', '.join(taken)} cannot be set here", "chat_template_kwargs")
        return self


class DetokenizeRequest(BaseModel):
    """SGLang's list of id lists is accepted too. `skip_special_tokens` defaults to false (vLLM's: what /tokenize
    gave decodes back to the same text); SGLang's true is one field away."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int] | list[list[int]] = Field(max_length=MAX_PROMPTS * 64)
    skip_special_tokens: bool = False
