"""`--policy kv_aware`: the (prefill, decode) pair of least cost, from the exact KV index (router/placement/kv_index.py).

One cost, in tokens, for a pair (p, d) and a prompt of n tokens whose chained page hashes are h:

    (n - page_size * credit(p, h))           prompt tokens the prefill must compute
  + page_size * (len(h) - credit(d, h))      tokens whose KV must cross to the decode (whole pages)
  + load_tokens * (in_flight(p) + in_flight(d))

credit counts the leading pages a worker can reuse, each at its tier's weight (KVIndex.credit): 1 on the device,
--kv-host-hit-weight in the host tier, --kv-store-hit-weight for a page only the KV store every server shares
holds (a prefill reads it from there; a decode never does: 0 for it), as Dynamo weighs host hits with
--router-host-cache-hit-weight.

The terms of p and of d are separate, so the least-cost pair is the least-cost prefill with the least-cost decode,
and kv_aware is a policy of one side like the others (`--decode-policy kv_aware` picks only the decode by it);
ties go to the less loaded worker, then to the first listed. A prompt the router cannot tokenize (chat messages:
the chat template is the server's) matches nothing and is placed by load alone. A request under a LoRA adapter
hashes its pages from the adapter's root (common/wire/kv_events.py `adapter_root`), as its workers' events do: a
prefix another adapter (or the base model) cached is no credit to it. Under the other policies the
router still follows the events and counts what the chosen pair held (`observe`), so policies compare.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.wire.kv_events import block_hashes
from router.adapters import request_adapter
from router.metrics import RouterMetrics
from router.placement.kv_feeds import KVFeeds
from router.placement.kv_index import KVIndex
from router.workers import Worker


class KVAwarePolicy:
    """The KV index's costs: `side(role)` picks a worker of that role by them (the policy kv_aware), `observe`
    counts what a chosen pair held (under every policy)."""

    def __init__(
        self,
        index: KVIndex,
        feeds: KVFeeds,
        load_tokens: int,
        metrics: RouterMetrics | None = None,
        host_weight: float = 1.0,
        store_weight: float = 0.5,
    ):
        self.index, self.feeds, self.load_tokens, self.metrics = index, feeds, load_tokens, metrics
        self.weights, self.store_weight = {"GPU": 1.0, "CPU": host_weight}, store_weight
        self._tokenizer: Any = None
        self._tokenizer_of: str | None = None
        self._last: tuple[dict[str, Any], int | None, tuple[int, int, list[int]]] | None = None

    def side(self, role: str) -> KVSide:
        return KVSide(self, role)

    def cost(self, role: str, worker: Worker, body: dict[str, Any]) -> tuple[float, int]:
        """(cost in tokens, requests in flight): a prefill's tokens to compute, a decode's tokens to cross."""
        n, page, hashes = self._pages(body)
        store = self.store_weight if role == "prefill" else 0.0
        matched = page * self.index.credit(worker.url, hashes, self.weights, store)
        tokens = n - matched if role == "prefill" else page * len(hashes) - matched
        return tokens + self.load_tokens * worker.in_flight, worker.in_flight

    def observe(self, prefill: Worker, decode: Worker, body: dict[str, Any]) -> None:
        """Count what a chosen pair held of the prompt (the same metrics under every policy, for comparison)."""
        if self.metrics is None or self.feeds.block_size() is None:
            return
        n, page, hashes = self._pages(body)
        if n:
            self.metrics.kv_prompt_tokens.inc(n)
            self.metrics.kv_matched_tokens.labels("prefill").inc(page * self.index.matched(prefill.url, hashes))
            self.metrics.kv_matched_tokens.labels("decode").inc(page * self.index.matched(decode.url, hashes))

    def page_size(self) -> int | None:
        return self.feeds.block_size()

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        """The prompt's length in tokens: exact when the router can tokenize it; for chat messages (whose template
        is the server's) the tokens of their contents, a little short of the templated prompt."""
        n = self._pages(body)[0]
        if n or not isinstance(body.get("messages"), list):
            return n
        texts = [m.get("content") for m in body["messages"] if isinstance(m, dict)]
        text = "\n".join(t if isinstance(t, str) else json.dumps(t) for t in texts if t)
        tokenizer = self._load_tokenizer()
        return len(tokenizer.encode(text).ids) if tokenizer is not None and text else len(text) // 4

    def held_tokens(self, worker: Worker, body: dict[str, Any]) -> int:
        """The prompt's leading tokens the worker's cache holds, by the index (whole pages)."""
        _, page, hashes = self._pages(body)
        return page * self.index.matched(worker.url, hashes) if hashes else 0

    def held(self, worker: Worker, body: dict[str, Any]) -> bool | None:
        """Whether the worker holds any of the prompt; None when the router cannot tell (no events, no tokens)."""
        _, _, hashes = self._pages(body)
        return bool(self.index.matched(worker.url, hashes)) if hashes else None

    def _pages(self, body: dict[str, Any]) -> tuple[int, int, list[int]]:
        """(prompt tokens, page size, the chained hashes of its whole pages); no pages when not tokenizable.
        The last body's are kept: both sides and `observe` ask for the same request's."""
        block = self.feeds.block_size()
        if self._last is not None and self._last[0] is body and self._last[1] == block:
            return self._last[2]
        ids, page = self.prompt_ids(body), block or 0
        adapter = request_adapter(body, self.feeds.workers.workers.values())
        pages = len(ids or ()), page, block_hashes(ids, page, adapter) if ids and page else []
        self._last = body, block, pages
        return pages

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


class KVSide:
    """kv_aware for one role: the worker of least cost; ties go to the less loaded, then to the first listed."""

    def __init__(self, kv: KVAwarePolicy, role: str):
        self.kv, self.role = kv, role

    def pick(self, workers: list[Worker], body: dict[str, Any]) -> Worker:
        return min(workers, key=lambda w: self.kv.cost(self.role, w, body))
