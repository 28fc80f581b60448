"""A request the router may move to another (prefill, decode) pair while it streams (router/migration.py):
the `migration` field the router adds to both halves' body, and the token trace a decode's stream then
carries back. Torch-free: the router and the servers share it.

    router ── body + "migration": {"rid", "created", "seed", "resume", "handover"} ──▶ prefill and decode
    decode ── each SSE event preceded by  : trace {"i": choice, "ids": [...], "p": prompt, "f": 1}  ──▶ router

The trace names the event's choice, the tokens it adds (an event that shows no text still carries a trace of
its own), the prompt's length (first trace of a choice) and whether it ends the choice; the router strips it.
On the first try `resume` is null. After a cut, `resume[i]` is choice i as the client has it: null when the
client saw nothing of it, else the tokens it was shown (`output_ids`), whether it had ended, and for
/generate, whose events are cumulative, the text and logprobs shown. Both halves then run the prompt plus
those tokens (the prefill computes only what its cache lacks, the decode receives only what its cache lacks),
the emitted tokens replayed into the detokenizer and the stop strings without being shown again, and go on
from there: the same `rid` and `created`, the same random stream (`seed`, choice, position), no chat role
event and no echo again. A request with a seed of its own keeps it; `seed` is for those without one.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from common.wire.sampling_params import INT64_MAX, INT64_MIN

TRACE = b": trace "


class ResumedChoice(BaseModel):
    """One choice as the client has it when its stream moved (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    output_ids: list[int] = Field(default_factory=list, max_length=1_000_000)
    finished: bool = False
    # /generate only (its events repeat everything so far): the text and the logprobs already shown
    text: str | None = None
    output_token_logprobs: list[Any] | None = None
    output_top_logprobs: list[Any] | None = None

    def logprobs(self) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        """The shown tokens' logprobs and top logprobs as a Choice holds them (empty lists when not shown)."""
        values = [entry[0] for entry in self.output_token_logprobs or []]
        tops = [None if top is None else [(t, lp) for lp, t, _ in top] for top in self.output_top_logprobs or []]
        return values, tops


class Migration(BaseModel):
    """The `migration` field (module docstring): the request's identity across the pairs that serve it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str = Field(min_length=1, max_length=256)
    created: int = Field(ge=0)
    seed: int = Field(ge=INT64_MIN, le=INT64_MAX)
    resume: list[ResumedChoice | None] | None = Field(None, max_length=16)
    # the router had another healthy decode when it sent this: a draining decode may hand it back at once
    # (common/http/drain.py); without one it finishes the request within its drain timeout
    handover: bool = False


def trace(choice: int, ids: list[int], prompt_len: int | None = None, finished: bool = False) -> bytes:
    """The trace line of one event (it precedes the event's `data:` line, or ends an event of its own)."""
    fields: dict[str, Any] = {"i": choice, "ids": ids}
    if prompt_len is not None:
        fields["p"] = prompt_len
    if finished:
        fields["f"] = 1
    return TRACE + json.dumps(fields, separators=(",", ":")).encode() + b"\n"


def split_trace(event: bytes) -> tuple[dict[str, Any] | None, bytes]:
    """(the trace of one whole SSE event, or None, and the event without it; b"" when it was all trace)."""
    if not event.startswith(TRACE):
        return None, event
    line, _, rest = event.partition(b"\n")
    return json.loads(line[len(TRACE) :]), (b"" if rest == b"\n" else rest)
