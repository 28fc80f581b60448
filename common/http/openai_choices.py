"""The choices of OpenAI's answers, whole or as one stream event's piece: a completion's text and logprobs
(with the prompt's first when echoed), a chat message and its logprobs."""

from __future__ import annotations

import itertools
from typing import Any

from common.core.request import GenInput
from common.http.chat_output import ChatShape
from common.http.serving import Choice

FINISH = {"stop": "stop", "length": "length"}


def finish_reason(c: Choice) -> str | None:
    return FINISH.get(c.finish.type) if c.finish else None


def completion_choice(tokenizer: Any, c: Choice, gen: GenInput, echo: str | None = None) -> dict[str, Any]:
    """With `echo` (the prompt's text), the prompt comes first: in the text and, token by token, in the logprobs."""
    logprobs = (
        completion_logprobs(tokenizer, c, gen.prompt_ids if echo is not None else None) if gen.return_logprob else None
    )
    return {"index": c.index, "text": (echo or "") + c.text, "logprobs": logprobs, "finish_reason": finish_reason(c)}


def chat_choice(tokenizer: Any, c: Choice, gen: GenInput, shape: ChatShape) -> dict[str, Any]:
    message, finish = shape.message(c.text, finish_reason(c))
    return {
        "index": c.index,
        "message": message,
        "logprobs": {"content": chat_logprobs(tokenizer, c)} if gen.return_logprob else None,
        "finish_reason": finish,
    }


def _token_str(tokenizer: Any, token: int) -> str:
    return tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token)])


def completion_logprobs(tokenizer: Any, c: Choice, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """OpenAI's logprobs of the choice's tokens, preceded by the prompt's when `prompt_ids` are given (the
    first prompt token has no logprob and no top logprobs: nothing predicted it)."""
    top_dict = lambda top: {_token_str(tokenizer, t): lp for t, lp in top or []}  # noqa: E731
    token_ids, token_logprobs, tops = c.output_ids, list(c.logprobs), [top_dict(top) for top in c.top_logprobs]
    if prompt_ids is not None:
        n = len(prompt_ids)
        token_ids = prompt_ids + token_ids
        token_logprobs = (c.meta.get("input_token_logprobs") or [None] * n) + token_logprobs
        prompt_tops = c.meta.get("input_top_logprobs") or [None] * n
        tops = [None] + [top_dict(top) for top in prompt_tops[1:]] + tops
    tokens = [_token_str(tokenizer, t) for t in token_ids]
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else [],
    }


def chat_logprobs(tokenizer: Any, c: Choice) -> list[dict[str, Any]]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        s = _token_str(tokenizer, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return [
        entry(t, lp) | {"top_logprobs": [entry(tt, tlp) for tt, tlp in top or []]}
        for t, lp, top in zip(c.output_ids, c.logprobs, c.top_logprobs)
    ]
