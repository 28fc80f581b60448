"""What a page is called in the store: `tandem-<namespace>-<page digest>`.

The page digest is the chained SHA-256 the KV cache events use (common/wire/kv_events.py): it digests the
page's token ids and every page before it, so equal keys mean equal prefixes. The namespace digests what else
decides a page's bytes (the model's identity and weights, the KV dtype, the page layout and size, the TP
rank), so two models or layouts never share an object. A page computed under a LoRA adapter chains from the
adapter's root (common/wire/kv_events.py `adapter_root`, by its name): the same tokens under two adapters never
share a key, on one server or on two that number their adapters differently.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from common.core.request import key_token_ids
from common.wire.kv_events import adapter_root, page_digests

DIGEST_BYTES = 16  # of the page digest, in the key and in the object's header


def store_namespace(**parts: Any) -> str:
    """A short digest of every value that decides a page's bytes besides its tokens."""
    text = json.dumps({k: str(v) for k, v in parts.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def page_key(namespace: str, digest: bytes) -> str:
    return f"tandem-{namespace}-{digest[:DIGEST_BYTES].hex()}"


def prefix_digests(
    keys: list[int], page_size: int, first: int, count: int, lora_name: str | None = None
) -> list[bytes]:
    """The digests of pages first .. first + count - 1 of `keys` (cache keys, Req.cache_key's: under the adapter
    `lora_name` when it is given), each chained from the first page."""
    tokens = key_token_ids(keys[: (first + count) * page_size])
    return page_digests(tokens, page_size, adapter_root(lora_name))[first : first + count]
