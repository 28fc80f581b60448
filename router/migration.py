"""Moving a request to another pair when its pair fails (Dynamo's --migration-limit; design:
docs/migration.md). The client sees one answer: one stream with no delta repeated or missing.

    try 1   pair (P1, D1), body + migration {rid, created, seed}    D1 dies after k tokens of choice i
    try 2   pair (P2, D2), body + migration {..., resume: [choice i: the k tokens shown, ...]}
            P2 computes the prompt + k tokens (its cache has the prompt); D2 goes on at token k + 1

`Moves` is one request's side: the `migration` field both halves get (common/wire/migration.py), the token
trace read off the decode's events (and stripped) to learn what each choice has shown, and whether a
failure moves the request: any failure of a worker (not the client's request), at most --migration-limit
times, while prompt + shown tokens stay within --migration-max-seq-len, and never once the client has
everything (the last choice ended). A streamed answer moves with what it has shown; a whole (JSON) answer
starts over, since the client has nothing yet: with the same seed, it draws the same tokens.

Who is avoided next: the worker that failed (a decode's error event with 502 or 504 is its PD peer's
failure: the prefill); when that leaves no pair, any healthy pair but those whose connection failed (the
failure may have been the pair's, not a worker's: a corrupted transfer).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from common.wire.migration import split_trace
from router.config import RouterConfig
from router.upstream import CLIENT_ERROR, DECODE_FAILED, PREFILL_FAILED, WORKER_DEAD, UpstreamError
from router.workers import Worker

ERROR_EVENT = b'data: {"error"'
PEER_FAULT_CODES = frozenset({502, 504})  # a decode's error event naming its prefill or the KV it sent


@dataclass
class ChoiceShown:
    """What the client has of one choice: whether it saw any of it, the tokens generated for it (one whose
    text is still held back included: the next server holds it back too), whether it ended, and its last
    event (/generate)."""

    traced: bool = False
    ids: list[int] = field(default_factory=list)
    finished: bool = False
    last: bytes | None = None

    def resume(self, generate: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"output_ids": self.ids, "finished": self.finished}
        if generate and self.last is not None:  # its events are cumulative: the next server goes on from them
            event = json.loads(self.last[self.last.index(b"data: ") + 6 :])
            meta = event.get("meta_info") or {}
            out["text"] = event.get("text", "")
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if meta.get(key) is not None:
                    out[key] = meta[key]
        return out


class Moves:
    """One request's migration state (module docstring); `limit` 0 turns it off."""

    def __init__(self, config: RouterConfig, path: str, body: dict[str, Any]):
        self.limit, self.max_seq_len = config.migration_limit, config.migration_max_seq_len
        self.generate = path == "/generate"
        self.choices = [ChoiceShown() for _ in range(choices(path, body))]
        self.identity = {"rid": f"{random.getrandbits(64):016x}", "created": int(time.time())}
        self.identity["seed"] = random.getrandbits(63)
        self.done = 0  # moves made
        self.exclude: set[str] = set()  # workers that failed this request
        self.lost: set[str] = set()  # of those, the ones whose connection failed (dead, most likely)
        self.prompt_len = 0
        self.shown_any = False  # an event of this request reached the client
        self.last_event_at = 0.0
        self.gap_from: float | None = None  # a move's: when the client's last event before the cut went out
        self.error: UpstreamError | None = None  # the last failure
        self.handover = False  # the router has another healthy decode: a draining one may hand this back

    @property
    def on(self) -> bool:
        return self.limit > 0

    def fields(self) -> dict[str, Any]:
        """What both halves' body gets: the `migration` field (nothing when off)."""
        if not self.on:
            return {}
        migration = dict(self.identity) | {"handover": self.handover}
        if self.shown_any:
            migration["resume"] = [c.resume(self.generate) if c.traced else None for c in self.choices]
        return {"migration": migration}

    def observe(self, whole: bytes, decode: Worker) -> tuple[bytes, UpstreamError | None]:
        """Whole SSE events of the decode with their traces read and stripped, up to an error event, which
        comes back as the UpstreamError it reports (a move may take it over; what follows it is dropped)."""
        out, error = [], None
        for event in whole.split(b"\n\n")[:-1]:
            trace, event = split_trace(event + b"\n\n")
            if trace is not None:
                self._note(trace, event)
            elif event.startswith(ERROR_EVENT):
                error = event_error(event, decode)
                break
            if event:
                out.append(event)
        if out:
            self.shown_any = True
            self.last_event_at = time.monotonic()
        return b"".join(out), error

    def _note(self, trace: dict[str, Any], event: bytes) -> None:
        i = trace["i"]
        self.choices += [ChoiceShown() for _ in range(i + 1 - len(self.choices))]
        choice = self.choices[i]
        choice.traced = True
        choice.ids += trace["ids"]
        choice.finished |= bool(trace.get("f"))
        self.prompt_len = trace.get("p", self.prompt_len)
        if event and self.generate:
            choice.last = event

    def again(self, error: UpstreamError, prefill: Worker, decode: Worker) -> str | None:
        """Whether `error` moves the request to another pair: the reason it is counted under, or None. The
        worker at fault is avoided from now on."""
        if not self.on or self.done >= self.limit or not error.upstream or not error.movable:
            return None
        if self.shown_any and all(c.finished for c in self.choices):
            return None  # the client has every token; what is missing is the end of the stream
        longest = self.prompt_len + max(len(c.ids) for c in self.choices)
        if self.max_seq_len is not None and longest > self.max_seq_len:
            return None
        self.done += 1
        self.gap_from = self.last_event_at if self.shown_any else None
        blamed = prefill if error.cause == PREFILL_FAILED else error.worker or decode
        self.exclude.add(blamed.url)
        if error.worker_failed or error.cause == WORKER_DEAD:
            self.lost.add(blamed.url)
        return error.cause

    def gap(self) -> float | None:
        """Once after a move of a stream: seconds from the client's last event before the cut to now (its
        first one after)."""
        if self.gap_from is None:
            return None
        gap, self.gap_from = time.monotonic() - self.gap_from, None
        return gap


def choices(path: str, body: dict[str, Any]) -> int:
    """The request's `n` as its workers read it (1 where the body does not say; they refuse a bad one)."""
    params = body.get("sampling_params") if path == "/generate" else body
    n = params.get("n", 1) if isinstance(params, dict) else 1
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 16 else 1


def event_error(event: bytes, decode: Worker) -> UpstreamError:
    """A decode's error event as the failure it reports: 4xx the client's request, 502/504 its prefill peer
    or the KV (PEER_FAULT_CODES), else the decode itself."""
    body = json.loads(event[event.index(b"data: ") + 6 :])
    code = body["error"].get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    if 400 <= status < 500 and status not in (408, 409, 429):
        cause = CLIENT_ERROR
    else:
        cause = PREFILL_FAILED if status in PEER_FAULT_CODES else DECODE_FAILED
    return UpstreamError(status, body, cause, decode)
