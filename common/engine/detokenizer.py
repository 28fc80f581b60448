"""Incremental detokenization that never emits half a UTF-8 character, and stop-string matching that
never emits text that might turn out to be the start of a stop string."""

from __future__ import annotations


class IncrementalDetokenizer:
    """vLLM's prefix/read-offset technique: decode a short window and emit only its stable new part."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Text that became final with these tokens ('' while a character is incomplete)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back, at the end of the request."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        return delta


class StopStringMatcher:
    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = stops
        self.include_stop = include_stop
        self.held = ""

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string if one just matched)."""
        buf = self.held + delta
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            pos, stop = min(hits)
            self.held = ""
            return buf[:pos] + (stop if self.include_stop else ""), stop
        keep = max((self._partial(buf, s) for s in self.stops), default=0)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def pass_through(self, delta: str) -> str:
        """Text that must not be searched (before min_new_tokens): all of it is safe to emit."""
        out, self.held = self.held + delta, ""
        return out

    @staticmethod
    def _partial(buf: str, stop: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of stop."""
        for k in range(min(len(stop) - 1, len(buf)), 0, -1):
            if buf.endswith(stop[:k]):
                return k
        return 0

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
