"""The fixed-size aux record prefill writes into the decode's aux slot after the last KV chunk: the first sampled
token and its logprobs, and for NEXTN, EAGLE and EAGLE3 the prompt's last hidden state (`hidden`, a size both
sides derive from the model: `record_bytes`; EAGLE3's is three layers' inputs)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAX_TOP = 20
_HEAD = struct.Struct("<qiiifi")  # room, first token, cached tokens, prompt len, logprob, number of top entries
_TOP = struct.Struct(f"<{MAX_TOP}i{MAX_TOP}f")
RECORD_BYTES = _HEAD.size + _TOP.size  # without a hidden state
NO_LOGPROB = float("nan")


@dataclass
class AuxRecord:
    room_id: int
    first_token: int
    cached_tokens: int
    prompt_len: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    hidden: bytes = b""  # NEXTN, EAGLE, EAGLE3: the target's hidden state at the prompt's last position (float32)

    def pack(self) -> bytes:
        top = (self.top_logprobs or [])[:MAX_TOP]
        ids = [t for t, _ in top] + [0] * (MAX_TOP - len(top))
        lps = [lp for _, lp in top] + [0.0] * (MAX_TOP - len(top))
        lp = NO_LOGPROB if self.logprob is None else self.logprob
        n_top = len(top) if self.top_logprobs is not None else -1
        head = _HEAD.pack(self.room_id, self.first_token, self.cached_tokens, self.prompt_len, lp, n_top)
        return head + _TOP.pack(*ids, *lps) + self.hidden

    @classmethod
    def unpack(cls, raw: bytes, hidden_bytes: int = 0) -> AuxRecord:
        if len(raw) != RECORD_BYTES + hidden_bytes:
            raise ValueError(f"aux record has {len(raw)} bytes, expected {RECORD_BYTES + hidden_bytes}")
        room, tok, cached, plen, lp, n_top = _HEAD.unpack_from(raw)
        vals = _TOP.unpack_from(raw, _HEAD.size)
        top = None if n_top < 0 else [(vals[i], vals[MAX_TOP + i]) for i in range(min(n_top, MAX_TOP))]
        return cls(room, tok, cached, plen, None if lp != lp else lp, top, raw[RECORD_BYTES:])


def record_bytes(hidden_bytes: int = 0) -> int:
    """One record's size: with `hidden_bytes` of hidden state (0 but for NEXTN, EAGLE and EAGLE3)."""
    return RECORD_BYTES + hidden_bytes
