"""`--policy kv_aware`: the (prefill, decode) pair of least cost, from the exact KV index (router/kv_index.py).

One cost, in tokens, for a pair (p, d) and a prompt of n tokens whose chained page hashes are h:

    (n - page_size * matched(p, h))          prompt tokens the prefill must compute
  + page_size * (len(h) - matched(d, h))     tokens whose KV must cross to the decode (whole pages)
  + load_tokens * (in_flight(p) + in_flight(d))

The terms of p and of d are separate, so the least-cost pair is the least-cost prefill with the least-cost decode;
ties go to the less loaded worker, then to the first listed. A prompt the router cannot tokenize (chat messages:
the chat template is the server's) matches nothing and is placed by load alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.wire.kv_events import block_hashes
from router.kv_feeds import KVFeeds
from router.kv_index import KVIndex
from router.workers import Worker


class KVAwarePolicy:
    def __init__(self, index: KVIndex, feeds: KVFeeds, load_tokens: int):
        self.index, self.feeds, self.load_tokens = index, feeds, load_tokens
        self._tokenizer: Any = None
        self._tokenizer_of: str | None = None

    def pick_pair(self, prefills: list[Worker], decodes: list[Worker], body: dict[str, Any]) -> tuple[Worker, Worker]:
        ids = self.prompt_ids(body)
        page = self.feeds.block_size()
        hashes = block_hashes(ids, page) if ids and page else []
        n = len(ids or ())

        def prefill_cost(w: Worker) -> tuple[int, int]:
            compute = n - (page or 0) * self.index.matched(w.url, hashes)
            return compute + self.load_tokens * w.in_flight, w.in_flight

        def decode_cost(w: Worker) -> tuple[int, int]:
            cross = (page or 0) * (len(hashes) - self.index.matched(w.url, hashes))
            return cross + self.load_tokens * w.in_flight, w.in_flight

        return min(prefills, key=prefill_cost), min(decodes, key=decode_cost)

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
