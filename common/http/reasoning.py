"""The thinking part of a reasoning model's answer (`--reasoning-parser`, SGLang's and vLLM's names), split
from the rest: `message.reasoning_content` and `message.content`, or their deltas.

| parser | the answer starts | thinking ends at |
| --- | --- | --- |
| deepseek-r1 | in thinking (its template opens `<think>`; a `<think>` the model writes itself is dropped) | `</think>`; without it the whole answer is thinking |
| qwen3 | in thinking if the model writes `<think>` first; otherwise all content | `</think>` |

A chat template that closed the thinking itself (Qwen3's `enable_thinking: false`) leaves an answer
without markers: all content. The engine applies a grammar only after `</think>` (ReqGrammar's gate).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of `text`, the answer so far. Not `final`: what could still turn out to be
        part of a marker is in neither (a stream sends it once it knows)."""
        body = text.lstrip()
        if not final and START.startswith(body) and body != START:  # "<thi" may become "<think>"
            return "", ""
        opened = body.startswith(START)
        if opened:
            body = body[len(START) :]
        elif self.name == "qwen3":
            return "", text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END) :].lstrip()
        if final:
            return body, ""
        return body[: len(body) - _partial(body, END)], ""


def _partial(text: str, marker: str) -> int:
    """Characters at the end of `text` that begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


PARSERS = {"deepseek-r1": ReasoningParser("deepseek-r1"), "qwen3": ReasoningParser("qwen3")}
