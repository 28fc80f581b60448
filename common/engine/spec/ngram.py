"""NGRAM drafting (prompt lookup): the tokens that followed the latest earlier occurrence of the request's
last w tokens, for the longest w in [min_window, max_window] that occurred before. No model, no KV: what
it drafts comes from the request's own prompt and output, so it costs a few dict lookups per step and
nothing crosses PD but the tokens.

Each request's index (w-gram -> where it last ended) is built once from its prompt and then extended by
the tokens committed since, and lives as long as the request object (a weak reference): a retracted
request keeps it; a PD decode or a migrated request builds its own from the tokens it was sent.
"""

from __future__ import annotations

import weakref

from common.core.request import Req
from common.engine.spec.drafter import Drafter


class NgramIndex:
    def __init__(self, windows: range):
        self.windows = windows
        self.last_end: dict[tuple[int, ...], int] = {}  # a w-gram -> the largest end index it was seen at
        self.indexed = 0  # ends 1..indexed are in last_end

    def add_ends(self, tokens: list[int], upto: int) -> None:
        """Index the w-grams ending at every index in (self.indexed, upto]."""
        for end in range(self.indexed + 1, upto + 1):
            for w in self.windows:
                if w > end:
                    break
                self.last_end[tuple(tokens[end - w : end])] = end
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of the longest matching suffix of `tokens`."""
        n = len(tokens)
        self.add_ends(tokens, n - 1)  # every earlier end; the suffix itself (end n) must not match itself
        for w in reversed(self.windows):
            if w > n:
                continue
            end = self.last_end.get(tuple(tokens[n - w :]))
            if end is not None:  # what followed it; past the end the match repeats (a period shorter than k)
                out: list[int] = []
                for i in range(end, end + k):
                    out.append(tokens[i] if i < n else out[i - n])
                return out
        return []


class NgramDrafter(Drafter):
    def __init__(self, min_window: int, max_window: int):
        self.windows = range(min_window, max_window + 1)
        self.indexes: weakref.WeakKeyDictionary[Req, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        return [self._one(req, k) if k > 0 else [] for req, k in zip(reqs, limits)]

    def _one(self, req: Req, k: int) -> list[int]:
        index = self.indexes.get(req)
        if index is None:
            index = self.indexes[req] = NgramIndex(self.windows)
        return index.propose(req.fill_ids, k)

    def describe(self) -> str:
        return f"NGRAM (match windows {self.windows.start}-{self.windows.stop - 1})"
