"""`--policy kv_aware`: the (prefill, decode) pair of least cost, from the exact KV index (router/kv_index.py).

One cost, in tokens, for a pair (p, d) and a prompt of n tokens whose chained page hashes are h:

    (n - page_size * matched(p, h))          prompt tokens the prefill must compute
  + page_size * (len(h) - matched(d, h))     tokens whose KV must cross to the decode (whole pages)
  + load_tokens * (in_flight(p) + in_flight(d))

The terms of p and of d are separate, so the least-cost pair is the least-cost prefill with the least-cost decode;
ties go to the less loaded worker, then to the first listed. A prompt the router cannot tokenize (chat messages:
the chat template is the server's) matches nothing and is placed by load alone. Under the other policies the
router still follows the events and counts what the chosen pair held (`observe`), so policies compare.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.wire.kv_events import block_hashes
from router.kv_feeds import KVFeeds
from router.kv_index import KVIndex
from router.metrics import RouterMetrics
from router.workers import Worker


class KVAwarePolicy:
    def __init__(self, index: KVIndex, feeds: KVFeeds, load_tokens: int, metrics: RouterMetrics | None = None):
        self.index, self.feeds, self.load_tokens, self.metrics = index, feeds, load_tokens, metrics
        self._tokenizer: Any = None
        self._tokenizer_of: str | None = None

    def pick_pair(self, prefills: list[Worker], decodes: list[Worker], body: dict[str, Any]) -> tuple[Worker, Worker]:
        n, page, hashes = self._pages(body)

        def prefill_cost(w: Worker) -> tuple[int, int]:
            compute = n - page * self.index.matched(w.url, hashes)
            return compute + self.load_tokens * w.in_flight, w.in_flight

        def decode_cost(w: Worker) -> tuple[int, int]:
            cross = page * (len(hashes) - self.index.matched(w.url, hashes))
            return cross + self.load_tokens * w.in_flight, w.in_flight

        p, d = min(prefills, key=prefill_cost), min(decodes, key=decode_cost)
        self._count(p, d, n, page, hashes)
        return p, d

    def observe(self, prefill: Worker, decode: Worker, body: dict[str, Any]) -> None:
        """Count what another policy's pair held of the prompt (the same metrics, for comparison)."""
        if self.feeds.block_size() is not None:
            self._count(prefill, decode, *self._pages(body))

    def _pages(self, body: dict[str, Any]) -> tuple[int, int, list[int]]:
        """(prompt tokens, page size, the chained hashes of its whole pages); no pages when not tokenizable."""
        ids, page = self.prompt_ids(body), self.feeds.block_size() or 0
        return len(ids or ()), page, block_hashes(ids, page) if ids and page else []

    def _count(self, p: Worker, d: Worker, n: int, page: int, hashes: list[int]) -> None:
        if self.metrics is not None and n:
            self.metrics.kv_prompt_tokens.inc(n)
            self.metrics.kv_matched_tokens.labels("prefill").inc(page * self.index.matched(p.url, hashes))
            self.metrics.kv_matched_tokens.labels("decode").inc(page * self.index.matched(d.url, hashes))

    def prompt_ids(self, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids: given (input_ids, or a prompt of ids), or the text tokenized as the servers do."""
        for key in ("input_ids", "prompt"):
            value = body.get(key)
            if isinstance(value, list) and value and all(type(t) is int for t in value):
                return value
        text = body.get("text", body.get("prompt"))
        if isinstance(text, str):
            tokenizer = self._load_tokenizer()
            return tokenizer.encode(text).ids if tokenizer is not None else None
        return None

    def _load_tokenizer(self) -> Any:
        """The workers' tokenizer (their model directory's tokenizer.json, when this host has it)."""
        path = self.feeds.model_path
        if path != self._tokenizer_of:
            self._tokenizer_of, self._tokenizer = path, None
            file = Path(path or "") / "tokenizer.json"
            if path and file.is_file():
                from tokenizers import Tokenizer

                self._tokenizer = Tokenizer.from_file(str(file))
        return self._tokenizer
