"""The prompt's logprobs come from the prefill: the decode never runs the prompt through the model, so its
answer holds None for every prompt token. When the client asked for them, the router waits for the
prefill's answer before replying and copies them into the decode's, into a whole answer and into every
streamed event:

    /generate with return_logprob and logprob_start_len >= 0   meta_info.input_token_logprobs, input_top_logprobs
    /v1/completions with echo and logprobs                      the prompt's entries of choices[].logprobs
                                                                (token_logprobs, top_logprobs), in the first
                                                                answer or event of each choice
"""

from __future__ import annotations

import json
from typing import Any

from common.wire.sse import sse_event

INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs")


def wants_prompt_logprobs(path: str, body: dict[str, Any]) -> bool:
    """Whether the answer to `body` carries logprobs of prompt tokens, which only the prefill computes."""
    if path == "/generate":
        start = body.get("logprob_start_len", -1)
        return body.get("return_logprob") is True and isinstance(start, int) and start >= 0
    if path == "/v1/completions":
        return body.get("echo") is True and body.get("logprobs") is not None
    return False


class PromptLogprobs:
    """The prompt's logprobs from the prefill's answer, copied into the decode's answer or events."""

    def __init__(self, path: str, prefill_body: bytes) -> None:
        data = json.loads(prefill_body)
        first = data[0] if isinstance(data, list) else data  # every choice has the same prompt
        self.generate = path == "/generate"
        if self.generate:
            meta = first.get("meta_info", {})
            self.fields = {k: meta[k] for k in INPUT_KEYS if k in meta}
        else:
            logprobs = first["choices"][0].get("logprobs") or {}
            n = first["usage"]["prompt_tokens"]
            self.token_logprobs = (logprobs.get("token_logprobs") or [])[:n]
            self.top_logprobs = (logprobs.get("top_logprobs") or [])[:n]
            self.choices_done: set[Any] = set()

    def answer(self, body: bytes) -> bytes:
        """A whole JSON answer of the decode, with the prompt's logprobs in."""
        data = json.loads(body)
        for item in data if isinstance(data, list) else [data]:
            self._merge(item)
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()

    def events(self, whole: bytes) -> bytes:
        """Whole SSE events (`data: ...\\n\\n` each) of the decode, with the prompt's logprobs in."""
        out = []
        for event in whole.split(b"\n\n")[:-1]:
            if event.startswith(b"data: {"):
                item = json.loads(event[6:])
                if "error" not in item:
                    self._merge(item)
                    out.append(sse_event(item))
                    continue
            out.append(event + b"\n\n")
        return b"".join(out)

    def _merge(self, item: dict[str, Any]) -> None:
        if self.generate:
            if isinstance(item.get("meta_info"), dict):
                item["meta_info"].update(self.fields)
            return
        for choice in item.get("choices") or []:
            logprobs = choice.get("logprobs")
            if not logprobs or choice.get("index") in self.choices_done:
                continue
            self.choices_done.add(choice.get("index"))
            n = len(self.token_logprobs)
            logprobs["token_logprobs"][:n] = self.token_logprobs
            if logprobs.get("top_logprobs") is not None and self.top_logprobs:
                logprobs["top_logprobs"][:n] = self.top_logprobs
